"""Multi-query associative recall (MQAR, Zoology: Arora et al. 2023), generated with NumPy.

A sequence of T tokens: P key-value pairs k1 v1 k2 v2 ... (keys distinct, from
the lower half of the vocabulary, token 0 excluded; values from the upper
half), then the filler token 0 in which each of the P keys appears once more,
in a random order at random positions (as Zoology's MQAR). A dedicated filler
keeps the recall unambiguous: no key appears anywhere else. At each queried key
the model must emit its value; only those P positions count in the loss and
the accuracy.

Every batch is a function of (seed, step) alone, so a resumed run sees the same
data as one that never stopped. The held-out split comes from its own stream.
"""

from __future__ import annotations

import numpy as np

_TRAIN, _HELD_OUT = 0, 1
FILLER = 0  # the token between the queries; never a key or a value


def _first_distinct(rng: np.random.Generator, B: int, high: int, count: int) -> np.ndarray:
  """int [B, count]: `count` distinct integers from [0, high) per row."""
  return np.argsort(rng.random((B, high)), axis=1)[:, :count]


def make_examples(rng: np.random.Generator, batch_size: int, seq_len: int,
                  num_kv_pairs: int, vocab_size: int) -> dict[str, np.ndarray]:
  """{"tokens": int32 [B, T], "positions": int32 [B, P], "answers": int32 [B, P]}:
  at tokens[b, positions[b, p]] (a queried key) the model must emit answers[b, p]."""
  B, T, P, V = batch_size, seq_len, num_kv_pairs, vocab_size
  half = V // 2
  keys = 1 + _first_distinct(rng, B, half - 1, P)  # [B, P] from [1, V/2)
  values = rng.integers(half, V, (B, P))  # [B, P] from [V/2, V)
  tokens = np.full((B, T), FILLER)
  tokens[:, 0:2 * P:2] = keys
  tokens[:, 1:2 * P:2] = values
  query_pos = 2 * P + _first_distinct(rng, B, T - 2 * P, P)  # [B, P]
  order = _first_distinct(rng, B, P, P)  # [B, P]: which pair each query asks for
  rows = np.arange(B)[:, None]
  tokens[rows, query_pos] = np.take_along_axis(keys, order, axis=1)
  answers = np.take_along_axis(values, order, axis=1)
  return {"tokens": tokens.astype(np.int32), "positions": query_pos.astype(np.int32),
          "answers": answers.astype(np.int32)}


def train_batch(config, step: int) -> dict[str, np.ndarray]:
  """The training batch of `step`: a function of (config.seed, step) only."""
  rng = np.random.default_rng([config.seed, _TRAIN, step])
  return make_examples(rng, config.batch_size, config.seq_len, config.num_kv_pairs,
                       config.vocab_size)


def held_out(config) -> dict[str, np.ndarray]:
  """config.eval_examples examples from a stream no training batch draws from."""
  rng = np.random.default_rng([config.seed, _HELD_OUT])
  return make_examples(rng, config.eval_examples, config.seq_len, config.num_kv_pairs,
                       config.vocab_size)
