"""The seed's worked example: four tokens, computed three ways that must agree.

Run: python examples/worked_example.py
"""

import jax
import numpy as np

import jattn

# Token embeddings x [T, P] and projections W [P, H|D] (tokens as rows).
EMBEDDINGS = np.array([[1, 1, 1, 0], [1, 2, 1, 0], [0, 1, 0, 1], [0, 1, 1, 0]], np.float32)
W_Q = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 1], [1, 0, 0]], np.float32)
W_K = np.array([[1, 0, 0], [1, 1, 1], [1, 0, 1], [0, 1, 0]], np.float32)
W_V = np.array([[1, 2, 0], [1, 3, 1], [1, 0, 2], [1, 1, 0]], np.float32)


def rows_layout():
  """softmax(Q K^T / sqrt(d_k)) V with Q, K, V [T, H]."""
  q, k, v = jattn.project_qkv(EMBEDDINGS, W_Q, W_K, W_V, layout="rows")
  return q, k, v, jattn.attention(q, k, v, layout="rows")


def columns_layout():
  """V softmax(K^T Q / sqrt(d_k)) with Q, K, V [H, T]; transposed back to [T, D]."""
  q, k, v = jattn.project_qkv(EMBEDDINGS.T, W_Q.T, W_K.T, W_V.T, layout="columns")
  return jattn.attention(q, k, v, layout="columns").T


def vector_version():
  """One query at a time (`attend`), mapped over the queries with jax.vmap."""
  q, k, v = jattn.project_qkv(EMBEDDINGS, W_Q, W_K, W_V, layout="rows")
  return jax.vmap(jattn.attend, in_axes=(0, None, None))(q, k, v)


def show(name, array):
  print(f"{name}:\n{np.array2string(np.asarray(array), precision=4, floatmode='fixed')}")


def main():
  q, k, v, rows = rows_layout()
  show("Q = x W_q", q)
  show("K = x W_k", k)
  show("V = x W_v", v)
  show("attention, tokens as rows", rows)
  show("attention, tokens as columns (transposed back)", columns_layout())
  show("attention, vector version under vmap", vector_version())


if __name__ == "__main__":
  main()
