"""Multi-query associative recall (MQAR, Zoology: Arora et al. 2023), generated with NumPy.

A sequence of T tokens: P key-value pairs k1 v1 k2 v2 ... (keys distinct, from
the lower half of the vocabulary, token 0 excluded; values from the upper
half), then the filler token 0 in which each of the P keys appears once more,
in a random order at random positions (as Zoology's MQAR). A dedicated filler
keeps the recall unambiguous: no key appears anywhere else. At each queried key
the model must emit its value; only those P positions count in the loss and
the accuracy.

Training batches may differ from that task in two ways a config asks for (the
held-out examples never do): `config.train_query_fraction` puts a query at that
fraction of the positions after the pairs instead of P of them (keys drawn at
random, so a key may be asked several times or not at all; more answers to learn from
per sequence), and `config.curriculum` draws the first steps' batches from
other tasks (shorter ones, with their own fraction of queries).

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
                  num_kv_pairs: int, vocab_size: int,
                  query_fraction: float | None = None) -> dict[str, np.ndarray]:
  """{"tokens": int32 [B, T], "positions": int32 [B, Q], "answers": int32 [B, Q]}:
  at tokens[b, positions[b, q]] (a queried key) the model must emit answers[b, q].

  query_fraction None: Q = P, each key asked once (Zoology's MQAR). A float in
  (0, 1]: Q = max(P, that fraction of the T - 2P positions after the pairs),
  each query a key drawn at random from the P.
  """
  B, T, P, V = batch_size, seq_len, num_kv_pairs, vocab_size
  half = V // 2
  keys = 1 + _first_distinct(rng, B, half - 1, P)  # [B, P] from [1, V/2)
  values = rng.integers(half, V, (B, P))  # [B, P] from [V/2, V)
  tokens = np.full((B, T), FILLER)
  tokens[:, 0:2 * P:2] = keys
  tokens[:, 1:2 * P:2] = values
  if query_fraction is None:
    query_pos = 2 * P + _first_distinct(rng, B, T - 2 * P, P)  # [B, P]
    asked = _first_distinct(rng, B, P, P)  # [B, P]: which pair each query asks for
  else:
    Q = max(P, int(query_fraction * (T - 2 * P)))
    query_pos = 2 * P + np.sort(_first_distinct(rng, B, T - 2 * P, Q), axis=1)  # [B, Q]
    asked = rng.integers(0, P, (B, Q))  # keys drawn with replacement
  rows = np.arange(B)[:, None]
  tokens[rows, query_pos] = np.take_along_axis(keys, asked, axis=1)
  answers = np.take_along_axis(values, asked, axis=1)
  return {"tokens": tokens.astype(np.int32), "positions": query_pos.astype(np.int32),
          "answers": answers.astype(np.int32)}


def train_task(config, step: int) -> tuple[int, int, float | None]:
  """(T, P, query fraction) of the training batch of `step` (0-based): the first
  phase of config.curriculum ((steps, seq_len, num_kv_pairs, query_fraction), ...)
  not yet over, else the config's own task with config.train_query_fraction."""
  end = 0
  for steps, seq_len, num_kv_pairs, query_fraction in config.curriculum:
    end += steps
    if step < end:
      return seq_len, num_kv_pairs, query_fraction
  return config.seq_len, config.num_kv_pairs, config.train_query_fraction


def train_batch(config, step: int) -> dict[str, np.ndarray]:
  """The training batch of `step`: a function of (config.seed, step) only."""
  rng = np.random.default_rng([config.seed, _TRAIN, step])
  seq_len, num_kv_pairs, query_fraction = train_task(config, step)
  return make_examples(rng, config.batch_size, seq_len, num_kv_pairs, config.vocab_size,
                       query_fraction)


def held_out(config) -> dict[str, np.ndarray]:
  """config.eval_examples examples from a stream no training batch draws from."""
  rng = np.random.default_rng([config.seed, _HELD_OUT])
  return make_examples(rng, config.eval_examples, config.seq_len, config.num_kv_pairs,
                       config.vocab_size)
