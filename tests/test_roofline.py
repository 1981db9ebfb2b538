"""experiments/roofline.py: the model-FLOP count that benchmarks and gpu_smoke divide
by, checked against XLA's own count where XLA's is exact (one layer: no loop body
counted once), and the scan undercount that makes XLA's count unusable otherwise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import roofline
from rstar_jax.model import qwen3
from rstar_jax.model.config import Qwen3Config


def _xla_train_flops(cfg, batch, seq):
  from flax import nnx
  model = qwen3.create_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  tok = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, seq)))

  def loss(state, tok):
    m = nnx.merge(graphdef, state)
    h, _ = m(tok)
    return -m.token_logprobs(h[:, :-1], tok[:, 1:], chunk=seq).mean()
  return roofline.xla_cost(jax.jit(jax.value_and_grad(loss)), state, tok)["flops"]


def test_train_flops_match_xla_on_one_layer_and_xla_undercounts_the_scan():
  base = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
  one = Qwen3Config(num_hidden_layers=1, **base)
  ours, xla = roofline.train_flops(one, 4, 64), _xla_train_flops(one, 4, 64)
  # Elementwise work (norms, softmax, rope, the loss) is in XLA's count, not in 6N.
  assert 0.8 < ours / xla < 1.05, (ours, xla)
  four = Qwen3Config(num_hidden_layers=4, **base)
  xla4 = _xla_train_flops(four, 4, 64)
  assert xla4 < 0.6 * roofline.train_flops(four, 4, 64)   # the layer scan is seen once
  assert roofline.train_flops(four, 4, 64) > 3 * roofline.train_flops(one, 4, 64) * 0.9


def test_matmul_peak_and_row():
  assert roofline.matmul_peak_gflops(128, repeats=2) > 0
  r = roofline.row("x", 2e9, 0.5, 8.0)
  assert r["gflops"] == pytest.approx(4.0) and r["fraction_of_peak"] == pytest.approx(0.5)


def test_matmul_chain_counts_the_flops_xla_counts():
  chain, args, flops = roofline.matmul_chain(16, 32, 96, links=4)
  xla = roofline.xla_cost(chain, *args)["flops"]
  assert flops <= xla < 1.02 * flops, (flops, xla)   # tanh's few flops on top
  assert roofline.matmul_chain_gflops(16, 32, 96, links=4, repeats=2) > 0
