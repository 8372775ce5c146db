"""A stage run beside the main one, in a forked process, gives the result a serial run gives."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

import pytest

from traceinspect.parallel import Beside, _can_fork


def _pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def _fails_in_child(parent: int) -> str:
    if os.getpid() != parent:
        raise RuntimeError("only in the child")
    return "ran here"


def _always_fails(_: int) -> None:
    raise ValueError("the real error")


needs_fork = pytest.mark.skipif(not _can_fork(None), reason="no fork here, or a single CPU")


@needs_fork
def test_runs_in_a_child() -> None:
    pid, sq = Beside(_pid_and_square, 12).result()
    assert sq == 144 and pid != os.getpid()


def test_jobs_one_runs_here() -> None:
    pid, sq = Beside(_pid_and_square, 3, jobs=1).result()
    assert (pid, sq) == (os.getpid(), 9)


@needs_fork
def test_a_child_failure_is_retried_here() -> None:
    assert Beside(_fails_in_child, os.getpid()).result() == "ran here"


def test_a_real_error_is_raised_as_in_a_serial_run() -> None:
    with pytest.raises(ValueError, match="the real error"):
        Beside(_always_fails, 0).result()


@needs_fork
def test_analysis_same_with_and_without_the_second_process() -> None:
    from traceinspect.pipeline import analyze

    fix = os.path.join(os.path.dirname(__file__), "..", "fixtures", "slow-rank-eager")
    if not os.path.isdir(fix):
        pytest.skip("fixture not present")
    a = analyze([fix], use_cache=False).to_json()
    b = analyze([fix], use_cache=False, jobs=1).to_json()
    for doc in (a, b):
        doc["source"].pop("command", None)
        doc.pop("generated_at", None)
    assert a["collectives"] == b["collectives"] and a["critical_path"] == b["critical_path"]
    assert a["findings"] == b["findings"]
    assert a == b  # the replay model and the tables' sections made in the child included


@needs_fork
def test_the_tables_sections_made_beside_are_used_only_for_their_tables() -> None:
    from traceinspect.document.build import build_document, trace_sections
    from traceinspect.pipeline import analyze

    fix = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tp1-l6-gather-eager")
    a = analyze([fix], use_cache=False)
    assert a.trace_sections is not None  # made in the child, kept for the document
    key, kept = a.trace_sections
    assert kept == trace_sections(a)
    marked = {**kept, "coverage": {"marker": True}}
    a.trace_sections = (key, marked)
    assert build_document(a, report=False)["coverage"] == {"marker": True}
    a.selected = a.selected.copy()  # other tables: the sections are made anew
    assert build_document(a, report=False)["coverage"] == kept["coverage"]


def _plus(n: int) -> Callable[[tuple[int, int]], tuple[int, int]]:
    def then(first: tuple[int, int]) -> tuple[int, int]:
        if n == 0:
            raise RuntimeError("the first follow-up fails")
        return os.getpid(), first[1] + n
    return then


@needs_fork
def test_several_parts_are_read_in_order_and_taken_in_any() -> None:
    b = Beside(_pid_and_square, 6, then=[_plus(0), _plus(1), _plus(2)])
    child, sq = b.result()
    assert sq == 36
    assert b.then_result(2) == (child, 38)  # parts 0 and 1 are read on the way
    assert b.then_result(1) == (child, 37)
    with pytest.raises(RuntimeError, match="first follow-up"):  # failed there: run here, and failing here too
        b.then_result(0)


def _wait_for(flag: str) -> Callable[[tuple[int, int]], tuple[int, str]]:
    def then(first: tuple[int, int]) -> tuple[int, str]:
        deadline = time.monotonic() + 120  # a bound on a hung wait, not a speed
        while not os.path.exists(flag):
            if time.monotonic() > deadline:
                return os.getpid(), "timed out: the first part was not taken before the second was made"
            time.sleep(0.01)
        return os.getpid(), f"after {first[1]}"
    return then


@needs_fork
def test_the_first_part_comes_while_the_child_makes_the_second(tmp_path) -> None:
    flag = str(tmp_path / "first-taken")
    b = Beside(_pid_and_square, 5, then=[_wait_for(flag)])
    pid, sq = b.result()  # the child is still in ``then``, waiting for the flag
    assert sq == 25 and pid != os.getpid()
    open(flag, "w").close()
    then_pid, text = b.then_result()
    assert text == "after 25" and then_pid == pid


def _then_fails_in_child(parent: int) -> Callable[[tuple[int, int]], str]:
    def then(first: tuple[int, int]) -> str:
        if os.getpid() != parent:
            raise RuntimeError("only in the child")
        return f"ran here after {first[1]}"
    return then


@needs_fork
def test_a_failure_of_the_second_part_is_retried_here() -> None:
    b = Beside(_pid_and_square, 4, then=[_then_fails_in_child(os.getpid())])
    assert b.result()[1] == 16
    assert b.then_result() == "ran here after 16"


def test_both_parts_run_here_with_jobs_one() -> None:
    b = Beside(_pid_and_square, 3, jobs=1, then=[lambda first: (os.getpid(), first[1] + 1)])
    assert b.result() == (os.getpid(), 9) and b.then_result() == (os.getpid(), 10)


@needs_fork
@pytest.mark.parametrize("close", [True, False])
def test_a_second_part_not_taken_ends_with_its_child(close: bool) -> None:
    """Closing without taking the second part closes the pipe: the child, blocked writing a part
    larger than a pipe holds, ends (and is reaped) instead of waiting for ever."""
    b = Beside(_pid_and_square, 2, then=[lambda first: b"x" * (4 << 20)])
    pid = b.result()[0]
    if close:
        b.close()
    else:
        del b  # dropped without a word: the same, once it is collected
        gc.collect()
    deadline = time.monotonic() + 120  # a bound on a hung wait, not a speed
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        pytest.fail("the child did not end")


def _beside_in_daemon(q) -> None:  # noqa: ANN001 - a multiprocessing queue
    pid, sq = Beside(_pid_and_square, 7).result()
    q.put((pid == os.getpid(), sq))


@needs_fork
def test_a_daemon_process_runs_it_itself() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_beside_in_daemon, args=(q,), daemon=True)  # daemons may not have children
    p.start()
    here, sq = q.get(timeout=60)
    p.join(timeout=60)
    assert here and sq == 49


def _analyze_in_daemon(q, fix: str) -> None:  # noqa: ANN001 - a multiprocessing queue
    from traceinspect.pipeline import analyze

    q.put(len(analyze([fix], use_cache=False).findings))


@needs_fork
def test_analysis_inside_a_daemon_process() -> None:
    import multiprocessing as mp

    fix = os.path.join(os.path.dirname(__file__), "..", "fixtures", "slow-rank-eager")
    if not os.path.isdir(fix):
        pytest.skip("fixture not present")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_analyze_in_daemon, args=(q, fix), daemon=True)
    p.start()
    n = q.get(timeout=300)
    p.join(timeout=60)
    assert n >= 1


def _held_hash(monkeypatch, gate) -> None:
    """Make every hash of a file wait for ``gate`` (a threading.Event) before it begins."""
    from traceinspect.load import raw

    real = raw._hash_file

    def held(f, size: int = 1 << 20) -> str:
        assert gate.wait(300)
        return real(f, size)

    monkeypatch.setattr(raw, "_hash_file", held)


def test_the_digest_is_told_once_the_hash_is_through(tmp_path, monkeypatch) -> None:
    """A pipe from Sha256After.told gets the hex digest when the hash thread is through, not before; asked
    once the hash is through, at once (and there is no writing end to close)."""
    import hashlib
    import select
    import threading

    from traceinspect.load.raw import Sha256After

    f = tmp_path / "r-TP-0.trace.json"
    f.write_bytes(b"[]" * 1000)
    gate = threading.Event()
    _held_hash(monkeypatch, gate)
    pending = Sha256After(f).start()
    r, w = pending.told()
    assert w >= 0 and not select.select([r], [], [], 0.2)[0]  # (the hash waits)
    gate.set()
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert select.select([r], [], [], 30)[0]
    assert os.read(r, 128) == want.encode() and os.read(r, 1) == b""
    os.close(r)
    assert pending.hexdigest() == want
    r, w = pending.told()
    assert w == -1 and os.read(r, 128) == want.encode()
    os.close(r)

    gone = tmp_path / "gone.json"  # a hash that fails tells ''
    gone.write_bytes(b"[]")
    failing = Sha256After(gone)
    failing._f.close()
    failing._t = threading.Thread(target=lambda: None)
    failing._t.start()
    failing._t.join()
    r, w = failing.told()
    assert w == -1 and os.read(r, 128) == b""
    os.close(r)


@pytest.mark.skipif(not _can_fork(None), reason="no process forked beside here")
def test_a_lone_rank_still_hashing_is_measured_beside_once_hashed(tmp_path, monkeypatch) -> None:
    """With the cache off a lone rank's file may still be hashing when the measures begin: the process
    forked beside the GEMM measure starts its work once the hash is through (the second core is the
    hash's until then) and holds the digest; the analysis is the one made with everything here."""
    import hashlib
    import threading
    from functools import partial

    from conftest import fixture_dir

    from traceinspect import pipeline
    from traceinspect.analysis import Options
    from traceinspect.load.raw import Sha256After
    from traceinspect.model.trace import RankInfo

    f = tmp_path / "r-TP-0.trace.json"
    f.write_bytes(b"[]" * 1000)
    gate = threading.Event()
    _held_hash(monkeypatch, gate)
    pending = Sha256After(f).start()
    info = RankInfo(rank=0, label="TP0", path=f, rank_source="filename", digest=pending)
    assert info.hashing
    told = pending.told()
    side = Beside(lambda: (time.monotonic(), info.digest), before=partial(pipeline._after_hash, info, told))
    os.close(told[0])
    assert side.forked
    time.sleep(0.3)
    released = time.monotonic()
    gate.set()
    started, digest = side.result()
    side.close()
    assert started >= released and digest == hashlib.sha256(f.read_bytes()).hexdigest()

    d = fixture_dir("kv-full-cast-eager")
    monkeypatch.undo()
    want = pipeline.analyze([d], Options(use_cache=False, jobs=1)).to_json()
    gate.clear()
    _held_hash(monkeypatch, gate)
    forked: list[bool] = []
    real_measure = pipeline.measure

    def measure(a):
        assert a.trace.ranks[0].hashing  # (held)
        threading.Timer(0.3, gate.set).start()
        m = real_measure(a)
        forked.append(m.side is not None and m.side.forked)
        return m

    monkeypatch.setattr(pipeline, "measure", measure)
    got = pipeline.analyze([d], Options(use_cache=False)).to_json()
    assert forked == [True]
    for doc in (want, got):
        doc["source"]["command"] = None
    assert got == want


def _big(first: tuple[int, int]) -> bytes:
    return bytes(range(256)) * (12 << 10) + first[1].to_bytes(4, "little")  # 3 MB, far more than a pipe holds


def _flag_after(flag: str) -> Callable[[tuple[int, int]], str]:
    def then(first: tuple[int, int]) -> str:
        open(flag, "w").close()
        return f"made after the large part, {first[1]}"
    return then


@needs_fork
def test_a_large_part_does_not_hold_up_the_next(tmp_path) -> None:
    """A part larger than a pipe holds goes through a memory file: the child goes on to its next part
    before this process reads the large one, and both read back exactly."""
    flag = str(tmp_path / "next-part-made")
    b = Beside(_pid_and_square, 9, then=[_big, _flag_after(flag)])
    assert b.result()[1] == 81
    deadline = time.monotonic() + 120  # a bound on a hung wait, not a speed
    while not os.path.exists(flag):  # the large part is not read yet
        assert time.monotonic() < deadline, "the child waited for the large part to be read"
        time.sleep(0.01)
    assert b.then_result(0) == _big((0, 81))
    assert b.then_result(1) == "made after the large part, 81"


@needs_fork
def test_large_parts_without_a_memory_file_come_through_the_pipe(monkeypatch) -> None:
    import traceinspect.parallel as parallel

    monkeypatch.setattr(parallel, "_memory_file", lambda: -1)
    b = Beside(_pid_and_square, 5, then=[_big, _plus(1)])
    child, sq = b.result()
    assert b.then_result(0) == _big((0, 25)) and b.then_result(1) == (child, 26)
