"""int8 pages against bfloat16 (and float32) pages on the MQAR model: recall accuracy
and how far the logits move.

Takes the latest checkpoint of an `examples/train.py` run in --workdir (the
default config, configs/mqar.py: T = 256, 32 key-value pairs; a few minutes on
2 CPU cores), training one there first if it holds none. Then for each page
dtype it decodes the held-out examples through `Transformer(..., decode=True)`
over a paged cache (`init_cache(paged=True, cache_dtype=...)`): the pairs as
one prefill, then --chunk tokens a call to the end, every token's logits kept
(teacher forcing: the true next token is fed, so every cache sees the same
tokens). The model computes in float32: over bfloat16 pages its queries are
cast to bfloat16 (decode_attention takes one float dtype), over int8 ones
they stay float32. Reported per dtype: the recall accuracy at the queried keys, the
largest |logit| difference from the float32 full pass (no cache) over the
queried positions and over all positions, and how many queried answers differ
from the full pass's argmax; and between bfloat16 and int8 pages.

  python benchmarks/int8_pages.py --workdir /tmp/jattn_mqar --out benchmarks/results/int8_pages_mqar.json
  python benchmarks/int8_pages.py --smoke --workdir /tmp/t     # configs/tiny.py: seconds, no figures
"""

import argparse
import json
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

import mqar_data  # noqa: E402
import training  # noqa: E402
from configs import mqar, tiny  # noqa: E402
from jattn.transformer import Transformer  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


def restore(config, workdir: pathlib.Path):
  """(model with the run's latest parameters, step); trains the run first if needed."""
  manager = ocp.CheckpointManager(workdir / "checkpoints")
  if manager.latest_step() is None:
    manager.close()
    print(f"no checkpoint in {workdir}: training configs/mqar.py there first", flush=True)
    training.train_and_evaluate(config, workdir)
    manager = ocp.CheckpointManager(workdir / "checkpoints")
  step = manager.latest_step()
  _, _, state = training.create_state(config)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  manager.close()
  model = Transformer(training.model_config(config), rngs=nnx.Rngs(0))
  nnx.update(model, state["params"])
  return model, step


@jax.jit
def _full_pass(graphdef, params, tokens):
  return nnx.merge(graphdef, params)(tokens)


def decode_logits(model, tokens, prefill: int, chunk: int, page_size: int, dtype):
  """float32 [B, T, V]: every token's logits, decoded over a paged cache of dtype pages."""
  B, T = tokens.shape
  model.init_cache(B, T, paged=True, page_size=page_size, cache_dtype=dtype)
  graphdef, caches, params = nnx.split(model, nnx.Cache, ...)

  @jax.jit
  def call(caches, params, tokens):
    m = nnx.merge(graphdef, caches, params)
    logits = m(tokens, decode=True, lengths=jnp.full((B,), tokens.shape[1], jnp.int32),
               deterministic=True)
    return nnx.state(m, nnx.Cache), logits

  out, at = [], 0
  for size in [prefill] + [chunk] * (-(-(T - prefill) // chunk)):
    size = min(size, T - at)
    caches, logits = call(caches, params, jnp.asarray(tokens[:, at:at + size]))
    out.append(np.asarray(logits, np.float32))
    at += size
  return np.concatenate(out, axis=1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/jattn_mqar"))
  parser.add_argument("--examples", type=int, default=64, help="held-out examples decoded")
  parser.add_argument("--chunk", type=int, default=1, help="tokens a decode call after the pairs")
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--smoke", action="store_true",
                      help="configs/tiny.py (a few steps: checks the script runs, no figures)")
  args = parser.parse_args()
  config = tiny.get_config() if args.smoke else mqar.get_config()
  model, step = restore(config, args.workdir)
  held = mqar_data.held_out(config)
  tokens = held["tokens"][:args.examples]
  positions, answers = held["positions"][:args.examples], held["answers"][:args.examples]
  rows = np.arange(len(tokens))[:, None]
  graphdef, params = nnx.split(model, nnx.Param)
  full = np.asarray(_full_pass(graphdef, params, jnp.asarray(tokens)), np.float32)
  queried = lambda logits: logits[rows, positions]  # [B, Q, V]
  full_answer = queried(full).argmax(-1)
  result = {"jax": jax.__version__, "machine": platform.machine(), "checkpoint_step": step,
            "workdir": str(args.workdir), "examples": len(tokens), "seq_len": config.seq_len,
            "num_kv_pairs": config.num_kv_pairs, "chunk": args.chunk,
            "page_size": args.page_size, "model_dtype": "float32",
            "full_pass": {"accuracy": float((full_answer == answers).mean()),
                          "max_abs_logit_queried": float(np.abs(queried(full)).max()),
                          "min_top2_margin_queried": float(np.diff(np.sort(
                              queried(full), axis=-1)[..., -2:], axis=-1).min())},
            "pages": {}}
  print(f"checkpoint step {step}; {len(tokens)} held-out examples of {config.seq_len} tokens, "
        f"{config.num_kv_pairs} pairs; full pass accuracy "
        f"{result['full_pass']['accuracy']:.4f}; queried logits up to "
        f"{result['full_pass']['max_abs_logit_queried']:.1f} in size, the top two at least "
        f"{result['full_pass']['min_top2_margin_queried']:.2f} apart", flush=True)
  got = {}
  for name, dtype in DTYPES.items():
    start = time.perf_counter()
    got[name] = decode_logits(model, tokens, 2 * config.num_kv_pairs, args.chunk,
                              args.page_size, dtype)
    answer = queried(got[name]).argmax(-1)
    r = {"accuracy": float((answer == answers).mean()),
         "answers_differing_from_full_pass": int((answer != full_answer).sum()),
         "max_abs_logit_diff_queried": float(np.abs(queried(got[name]) - queried(full)).max()),
         "max_abs_logit_diff_all": float(np.abs(got[name] - full).max()),
         "seconds": time.perf_counter() - start}
    result["pages"][name] = r
    print(f"{name:>8} pages: accuracy {r['accuracy']:.4f}, answers differing from the full "
          f"pass {r['answers_differing_from_full_pass']}, max |logit - full pass| "
          f"{r['max_abs_logit_diff_queried']:.4f} (queried), {r['max_abs_logit_diff_all']:.4f} "
          f"(all)", flush=True)
  diff = np.abs(got["int8"] - got["bfloat16"])
  result["int8_vs_bfloat16"] = {
      "max_abs_logit_diff_queried": float(queried(diff).max()),
      "max_abs_logit_diff_all": float(diff.max()),
      "answers_differing": int((queried(got["int8"]).argmax(-1)
                                != queried(got["bfloat16"]).argmax(-1)).sum())}
  print(f"int8 vs bfloat16 pages: {result['int8_vs_bfloat16']}")
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
  main()
