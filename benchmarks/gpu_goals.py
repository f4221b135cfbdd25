"""Issue 45's goals for the fast GPU path (item 4), read from a card run's timings, and
the fastest jattn path of each timed call (what the CUDA default should follow).

    python benchmarks/gpu_goals.py benchmarks/results/gpu_h100_mgpu_fast.json [more.json]

Reads the "speed" rows of tools/mgpu_fast_check.py's JSON (each: T, case, pass_ "fwd" or
"fwd+bwd", contender, ms; medians over interleaved rounds) and prints, per goal and
length, the two times compared, their ratio, and met / not met / not measured. jattn's
time for a call is its fastest path there: a contender named flex_gpu, flex_mgpu or
flex_mgpu_ws, with or without an option after a colon (":bwd", the warp-specialised
backward; ":mask_mod"; ":fma16"; ...), except ":tiles" (the to_tiles copies a check times
on purpose). The goals (bfloat16, H = 128):
  causal_vs_cudnn     causal as a mask_mod within 1.2x of cuDNN's causal (forward:
                      flex_mgpu_ws:mask_mod; forward + backward: the fastest jattn path
                      named ":mask_mod", else, in runs that timed none (2026-11-27's), the
                      fastest is_causal one, and the row says which)
  flex_attention      at least as fast as PyTorch FlexAttention on every mask (its FLASH
                      backend where the card's torch has it, else Triton: the faster row)
  documents_16        16 documents at least 4x faster than no mask at T = 16k
  soft_cap            soft-cap within 1.15x of plain causal
A goal whose rows the run lacks is "not measured", never met.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

JATTN = ("flex_gpu", "flex_mgpu", "flex_mgpu_ws")
FLEX_ATTENTION = ("torch_flex", "torch_flex:FLASH")
MASKS = ("causal", "documents", "window", "soft_cap", "alibi")  # FlexAttention's goal
BOUNDS = {"causal_vs_cudnn": 1.2, "flex_attention": 1.0, "documents_16": 1 / 4,
          "soft_cap": 1.15}  # ours / theirs at most this


def is_jattn(contender: str) -> bool:
  base, _, option = contender.partition(":")
  return base in JATTN and option != "tiles"


def _fastest(rows, case, T, pass_, accept) -> dict | None:
  found = [r for r in rows if r["case"] == case and r["T"] == T and r["pass_"] == pass_
           and accept(r["contender"])]
  return min(found, key=lambda r: r["ms"]) if found else None


def _named(name):
  return lambda contender: contender == name


def _pair(row) -> tuple | None:
  return (row["contender"], row["ms"]) if row else None


def _compare(goal, case, T, pass_, ours, theirs, what) -> dict:
  row = dict(goal=goal, case=case, what=what, T=T, pass_=pass_, bound=BOUNDS[goal],
             ours=_pair(ours), theirs=_pair(theirs), ratio=None, met=None)
  if ours and theirs:
    row["ratio"] = ours["ms"] / theirs["ms"]
    row["met"] = row["ratio"] <= row["bound"]
  return row


def goals(rows) -> list[dict]:
  """One entry per goal, case, length and pass that the goal names (the module doc): ours
  and theirs as (contender, ms) or None, ratio = ours / theirs, met (None: not measured)."""
  lengths = sorted({r["T"] for r in rows}) or [4096, 16384]
  out = []
  for T in lengths:
    out.append(_compare("causal_vs_cudnn", "causal", T, "fwd",
                        _fastest(rows, "causal", T, "fwd", _named("flex_mgpu_ws:mask_mod")),
                        _fastest(rows, "causal", T, "fwd", _named("cudnn")),
                        "causal as mask_mod / cuDNN causal"))
    as_mask_mod = _fastest(rows, "causal", T, "fwd+bwd",
                           lambda c: is_jattn(c) and c.endswith(":mask_mod"))
    out.append(_compare("causal_vs_cudnn", "causal", T, "fwd+bwd",
                        as_mask_mod or _fastest(rows, "causal", T, "fwd+bwd", is_jattn),
                        _fastest(rows, "causal", T, "fwd+bwd", _named("cudnn")),
                        f"causal ({'mask_mod' if as_mask_mod else 'is_causal'}) / cuDNN "
                        "causal"))
  for case in MASKS:
    for T in lengths:
      for pass_ in ("fwd", "fwd+bwd"):
        ours = _fastest(rows, case, T, pass_, is_jattn)
        theirs = _fastest(rows, case, T, pass_, lambda c: c in FLEX_ATTENTION)
        if ours or theirs or pass_ == "fwd":  # forward + backward where it was timed
          out.append(_compare("flex_attention", case, T, pass_, ours, theirs,
                              f"{case}: jattn / FlexAttention"))
  for pass_ in ("fwd", "fwd+bwd"):
    documents = _fastest(rows, "documents", 16384, pass_, is_jattn)
    if documents or pass_ == "fwd":
      out.append(_compare("documents_16", "documents", 16384, pass_, documents,
                          _fastest(rows, "no_mask", 16384, pass_, is_jattn),
                          "16 documents / no mask"))
  for T in lengths:
    for pass_ in ("fwd", "fwd+bwd"):
      soft = _fastest(rows, "soft_cap", T, pass_, is_jattn)
      if soft or pass_ == "fwd":
        out.append(_compare("soft_cap", "soft_cap", T, pass_, soft,
                            _fastest(rows, "causal", T, pass_, is_jattn),
                            "soft-cap / causal"))
  return out


def fastest(rows) -> list[dict]:
  """Per timed (case, T, pass_): the fastest jattn path and the fastest contender."""
  keys = sorted({(r["case"], r["T"], r["pass_"]) for r in rows})
  return [dict(case=case, T=T, pass_=pass_,
               jattn=_pair(_fastest(rows, case, T, pass_, is_jattn)),
               any=_pair(_fastest(rows, case, T, pass_, lambda c: True)))
          for case, T, pass_ in keys]


def report(rows) -> str:
  """The goals and the fastest paths as text tables."""
  word = {True: "met", False: "NOT met", None: "not measured"}
  side = lambda x: f"{x[0]} {x[1]:.3f} ms" if x else "-"
  lines = [f"{'goal':16s} {'T':>6s} {'pass':8s} {'what':36s} {'ratio':>6s} {'bound':>6s} "
           f"{'':12s} ours / theirs"]
  for g in goals(rows):
    ratio = f"{g['ratio']:.2f}" if g["ratio"] is not None else "-"
    lines.append(f"{g['goal']:16s} {g['T']:6d} {g['pass_']:8s} {g['what']:36s} {ratio:>6s} "
                 f"{g['bound']:6.2f} {word[g['met']]:12s} {side(g['ours'])} / "
                 f"{side(g['theirs'])}")
  lines += ["", f"{'case':10s} {'T':>6s} {'pass':8s} fastest jattn path / fastest contender"]
  for f in fastest(rows):
    lines.append(f"{f['case']:10s} {f['T']:6d} {f['pass_']:8s} {side(f['jattn'])} / "
                 f"{side(f['any'])}")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("results", nargs="+", type=pathlib.Path,
                      help="tools/mgpu_fast_check.py's JSON (its 'speed' rows)")
  args = parser.parse_args(argv)
  for path in args.results:
    try:
      result = json.loads(path.read_text())
      rows = result["speed"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      parser.error(f"results: {path} is not a GPU check's JSON with 'speed' rows "
                   f"({type(e).__name__}: {e})")
    print(f"{path}: {result.get('device', '?')}, jax {result.get('jax', '?')}, "
          f"{len(rows)} timings")
    print(report(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
