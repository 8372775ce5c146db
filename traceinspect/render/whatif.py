"""Plain-text lines about replayed fixes, shared by the terminal, Markdown and HTML renderers (each
escapes them for its own format)."""

from __future__ import annotations

from typing import Any

from traceinspect.units import fmt_pct_signed, fmt_us, fmt_us_signed, is_number


def variant_lines(f: dict[str, Any]) -> list[str]:
    """``with gather-then-cast: -3,147 µs per step (replayed step 3,372 µs; ...)``, one per declared fix."""
    out = []
    for fx in f.get("fixes") or []:
        sv, pred = fx.get("saving_us_per_step"), fx.get("predicted_step_us")
        tps, rep, b = fx.get("predicted_tokens_per_s"), fx.get("replayed_tokens_per_s"), fx.get("batch") or {}
        if is_number(tps) and is_number(rep) and rep and is_number(pred):
            out.append(f"with {fx.get('label')}: {float(tps):,.0f} tokens/s against {float(rep):,.0f} "
                       f"({fmt_pct_signed(float(tps) / float(rep) - 1.0)}; batch {b.get('observed') or 0:,.0f} → "
                       f"{b.get('predicted') or 0:,.0f}, step {fmt_us(float(pred))}; {fx.get('variant')})")
        elif is_number(sv) and is_number(pred):
            out.append(f"with {fx.get('label')}: {fmt_us_signed(-float(sv))} per step "
                       f"(replayed step {fmt_us(float(pred))}; {fx.get('variant')})")
        else:
            why = "; ".join(str(u) for u in fx.get("undecided") or [] if u) or "not replayable"
            out.append(f"with {fx.get('label')}: cannot be decided ({why})")
    return out


def group_note(f: dict[str, Any]) -> str | None:
    """Why a child finding's saving is not additional to its parent's."""
    g = f.get("group") or {}
    if g.get("parent"):
        return (f"shares its cause with {g['parent']}: fixing either removes much of the same time, so the "
                "savings overlap and do not add up")
    return None


def all_fixed_line(doc: dict[str, Any]) -> str | None:
    """The step with every finding fixed, from one replay (never a sum of savings)."""
    af = (doc.get("replay") or {}).get("all_fixed") or {}
    pred, rep = af.get("predicted_step_us"), af.get("replayed_step_us")
    if not is_number(pred) or not is_number(rep) or not rep:
        return None
    fixes = ", ".join(str(x) for x in af.get("fixes") or [])
    return (f"All findings fixed together (one replay of {fixes}): step {fmt_us(float(rep))} → "
            f"{fmt_us(float(pred))} ({fmt_pct_signed((float(pred) - float(rep)) / float(rep))} of the replayed step time)")
