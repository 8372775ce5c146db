"""Column helpers: the dictionary factorization agrees with pandas' on trace text columns."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from traceinspect.tables import factorize_text, in_key_order, string_column, unique_text

NAMES = ["void at::native::vectorized_elementwise_kernel<4, ...>", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
         "nvjet_sm90_tst_64x24_64x16_4x2_h_bz_NNT", "", "triton_per_fused_copy__mul_sum_0"]


@pytest.mark.parametrize("seed", range(5))
def test_factorize_text_matches_pandas(seed: int) -> None:
    rng = np.random.default_rng(seed)
    arr = np.array(NAMES, dtype=object)[rng.integers(0, len(NAMES), 1000)]
    codes, uniq = factorize_text(arr)
    ref_codes, ref_uniq = pd.factorize(arr)
    np.testing.assert_array_equal(codes, ref_codes)
    assert list(uniq) == list(ref_uniq)
    assert unique_text(arr) == list(pd.unique(arr))
    # pandas' own string storage takes the fast path and gives the same answer
    s = pd.Series(arr, dtype="string[pyarrow]")
    codes2, uniq2 = factorize_text(s)
    np.testing.assert_array_equal(codes2, ref_codes)
    assert list(uniq2) == list(ref_uniq)
    # and back: a string column from (codes, uniques)
    col = string_column(codes, uniq)
    assert [str(x) for x in col] == list(arr)


def test_factorize_text_keeps_none_and_bytes() -> None:
    arr = np.array([b"[[1, 2]]", None, b"[[1, 2]]", b"[]", None], dtype=object)
    codes, uniq = factorize_text(arr)
    assert codes.tolist() == [0, 1, 0, 2, 1]
    assert list(uniq) == [b"[[1, 2]]", None, b"[]"]
    assert factorize_text(np.array([], dtype=object))[0].tolist() == []


def test_ranks_with_different_strings_stack_into_one_categorical() -> None:
    from traceinspect.load import _concat

    a = pd.DataFrame({"op_name": string_column(np.array([0, 1, 0]), np.array(["b", "a"], dtype=object))})
    b = pd.DataFrame({"op_name": string_column(np.array([0, 1]), np.array(["c", "a"], dtype=object))})
    out = _concat([a, b], [0, 1])
    assert isinstance(out["op_name"].dtype, pd.CategoricalDtype)
    assert out["op_name"].tolist() == ["b", "a", "b", "c", "a"]
    assert list(out["op_name"].cat.categories) == ["a", "b", "c"]  # sorted: sorts as its strings do
    assert out["rank"].tolist() == [0, 0, 0, 1, 1]


def test_factorize_text_keeps_tuples_whole() -> None:
    keys = [("aten::mm", b"[[16, 2048]]", b"[]", b"[]"), ("aten::mm", b"[[8, 2048]]", b"[]", b"[]"),
            ("aten::mm", b"[[16, 2048]]", b"[]", b"[]")]
    codes, uniq = factorize_text(keys)
    assert codes.tolist() == [0, 1, 0] and uniq.shape == (2,) and uniq[1] == keys[1]


def test_combine_codes_numbers_combinations_in_order_of_appearance() -> None:
    from traceinspect.tables import combine_codes

    a = np.array([2, 0, 2, 1, 0, 2])
    b = np.array([5, 3, 5, 3, 3, 4])
    ref = pd.factorize(pd.MultiIndex.from_arrays([a, b]))[0]
    np.testing.assert_array_equal(combine_codes(a, b), ref)
    assert combine_codes(np.array([], dtype=np.int64)).tolist() == []


def test_per_distinct_tests_each_value_once() -> None:
    from traceinspect.tables import per_distinct

    seen: list[str] = []

    def test(v: str) -> bool:
        seen.append(v)
        return v.startswith("nccl")

    arr = np.array(["ncclA", "gemm", "ncclA", "gemm", "x"], dtype=object)
    assert per_distinct(pd.Series(arr), test).tolist() == [True, False, True, False, False]
    assert sorted(seen) == ["gemm", "ncclA", "x"]


def _dict_factorize(values: list) -> tuple[list[int], list]:
    """The reference: a dict numbering values in order of first appearance (hash and ==)."""
    seen: dict = {}
    codes = [seen.setdefault(v, len(seen)) for v in values]
    return codes, list(seen)


@pytest.mark.parametrize("case", ["repeated", "distinct-then-repeated", "equal-texts", "mixed"])
def test_factorize_text_numbers_values_as_a_dict_does(case: str) -> None:
    """Values seen before by address, equal values met as other objects, and columns of more distinct
    objects than are remembered by address all get the dict's numbering."""
    rng = np.random.default_rng(7)
    if case == "repeated":  # more distinct objects than the address table holds, each repeated
        pool = [f"op_{i}" for i in range(100_000)]
        values = [pool[i] for i in rng.integers(0, len(pool), 400_000)]
    elif case == "distinct-then-repeated":  # the table fills with new objects, then repeats arrive
        values = [f"x{i}" for i in range(150_000)]
        values += [values[i] for i in rng.integers(0, len(values), 50_000)]
    elif case == "equal-texts":  # one text as many objects: one code
        values = ["".join(["aten::", "mm"]) for _ in range(1000)] + ["aten::mm", "aten::bmm"] * 10
    else:
        nan, other_nan = float("nan"), float("nan")
        values = [1, 1.0, True, nan, nan, other_nan, None, b"a", "a", (1, 2), (1, 2), 0, False] * 3
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    codes, uniq = factorize_text(arr)
    ref_codes, ref_uniq = _dict_factorize(values)
    assert codes.tolist() == ref_codes
    assert len(uniq) == len(ref_uniq) and all(u is r for u, r in zip(uniq.tolist(), ref_uniq, strict=True))


def test_text_isin_agrees_with_pandas_on_short_and_long_columns() -> None:
    from traceinspect.tables import text_isin

    rng = np.random.default_rng(3)
    pool = np.array([*NAMES, None, "attention", "gemm_bf16"], dtype=object)
    for n in (10, 50_000):  # the long one is numbered first
        arr = pool[rng.integers(0, len(pool), n)]
        got = text_isin(arr, ("attention", "", "gemm_bf16"))
        want = pd.Series(arr, dtype=object).isin(["attention", "", "gemm_bf16"]).to_numpy()
        np.testing.assert_array_equal(got, want)
        assert got.dtype == bool and got.any() and not got.all()


@pytest.mark.parametrize("categorical", [True, False], ids=["categorical", "object"])
def test_class_matrix_equals_pivot_table(categorical: bool) -> None:
    """The document's per-step class table equals pandas' pivot table of the class time rows."""
    from traceinspect.document.build import _class_matrix

    rng = np.random.default_rng(3)
    cls = rng.choice(["gemm", "attention", "comm", "other"], 60)
    cs = pd.DataFrame({"rank": rng.integers(0, 2, 60), "step": rng.permutation(200)[:60],
                       "cls": pd.Categorical(cls, categories=["other", "gemm", "attention", "comm", "kv_cast"])
                       if categorical else pd.Series(cls, dtype=object),
                       "us": rng.random(60) * 100})
    steps = pd.Index(np.r_[cs["step"].to_numpy()[::2], [900, 901]])  # some steps have no rows
    names, present, values = _class_matrix(cs, steps)
    wide = cs.pivot_table(index="step", columns="cls", values="us", aggfunc="sum", fill_value=0.0, observed=True)
    assert names == [str(c) for c in wide.columns]
    assert present == steps.isin(wide.index).tolist()
    np.testing.assert_array_equal(values[np.array(present)], wide.reindex(steps[np.array(present)]).to_numpy())
    assert not values[~np.array(present)].any()


def test_in_key_order_is_a_lexsort_that_changes_nothing() -> None:
    """``in_key_order`` holds exactly when sorting the rows by (key, ts) would leave them where they are."""
    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 3, 10, 200):
        for _ in range(40):
            key = np.sort(rng.integers(0, 3, n)) if rng.random() < 0.7 else rng.integers(0, 3, n)
            ts = rng.integers(0, 4, n).astype(np.float64)
            if rng.random() < 0.5:  # mostly ordered within each key
                ts = ts[np.lexsort((ts, key))] if (key[1:] >= key[:-1]).all() else ts
            rows = np.lexsort((ts, key))
            want = bool((key[rows] == key).all() and (ts[rows] == ts).all())
            assert in_key_order(key, ts) is want, (key, ts)
