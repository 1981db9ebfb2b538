"""experiments/common/roofline.py: the model-FLOP count that benchmarks and gpu_smoke divide
by, checked against XLA's own count where XLA's is exact (one layer: no loop body
counted once), and the scan undercount that makes XLA's count unusable otherwise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import roofline
from rstar_jax.model import qwen3
from rstar_jax.model.model_config import Qwen3Config


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


def test_rates_are_hand_counted_work_over_the_measured_time(monkeypatch):
  """Each rate divides the FLOPs / bytes counted by hand here by the time measured: the
  timer is replaced by one that runs the step (so it compiles and runs for real) and
  reports 0.25 s."""
  ran = []

  def timed(fn, repeats):
    ran.append(repeats)
    fn()
    return 0.25
  monkeypatch.setattr(roofline, "_median_time", timed)
  assert roofline.matmul_peak_gflops(128, repeats=3) == pytest.approx(2 * 128**3 / 0.25 / 1e9)
  # 4 links alternating [16, 32] x [32, 96] and [16, 96] x [96, 32]: 2 m k n each.
  assert roofline.matmul_chain_gflops(16, 32, 96, links=4, repeats=2) == pytest.approx(
      4 * 2 * 16 * 32 * 96 / 0.25 / 1e9)
  # 4 MiB of float32 read once.
  assert roofline.memory_bandwidth_gbs(4, repeats=2) == pytest.approx(4 * 2**20 / 0.25 / 1e9)
  assert ran == [3, 2, 2]


def test_median_time_is_the_median_of_the_runs_after_a_warm_up(monkeypatch):
  clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])   # runs of 1, 3 and 2 s
  monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock))
  calls = []
  assert roofline._median_time(lambda: calls.append(1), 3) == 2.0
  assert len(calls) == 4   # the warm-up is not timed


def test_row():
  r = roofline.row("x", 2e9, 0.5, 8.0)
  assert r["gflops"] == pytest.approx(4.0) and r["fraction_of_peak"] == pytest.approx(0.5)
  assert roofline.row("y", 1e9, 0.0, 8.0)["gflops"] == 0.0


def test_train_flops_by_hand():
  """hidden 8, intermediate 16, 2 layers, 2 heads of 4 (q = 8), 1 kv head (kv = 4),
  vocab 32. Matmul parameters per layer: q and o 8 * 8 each, k and v 8 * 4 each, the MLP
  3 * 8 * 16: 576; two layers 1152, the head 8 * 32 = 256: N = 1408. Per token at S = 5:
  6 N = 8448 plus 12 L q S = 12 * 2 * 8 * 5 = 960; 3 x 5 tokens: 141120."""
  cfg = Qwen3Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4)
  assert roofline.matmul_params(cfg) == 1408
  assert roofline.train_flops(cfg, 3, 5) == 141120.0


def test_xla_counts_the_bytes_of_a_sum():
  """A float32 sum over n elements reads 4 n bytes and writes one float."""
  n = 1 << 16
  cost = roofline.xla_cost(jax.jit(jnp.sum), jnp.ones((n,), jnp.float32))
  assert cost["bytes_accessed"] == 4 * n + 4, cost


def test_matmul_chain_counts_the_flops_xla_counts():
  chain, args, flops = roofline.matmul_chain(16, 32, 96, links=4)
  xla = roofline.xla_cost(chain, *args)["flops"]
  assert flops == 4 * 2 * 16 * 32 * 96
  assert flops <= xla < 1.02 * flops, (flops, xla)   # tanh's few flops on top


def test_attention_flops_full_and_causal_by_hand():
  """The config of test_train_flops_by_hand (2 layers, q = 2 heads x 4 = 8) at S = 5,
  batch 3. Attention: 12 L q S^2 per sequence = 12 * 2 * 8 * 25 = 4800, x 3 = 14400 in
  full; the causal half 7200. 6 N = 8448 per token, x 15 tokens = 126720: train FLOPs
  141120 in full (as before), 133920 causal."""
  cfg = Qwen3Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4)
  assert roofline.attention_flops(cfg, 3, 5) == 14400.0
  assert roofline.attention_flops(cfg, 3, 5, causal=True) == 7200.0
  assert roofline.train_flops(cfg, 3, 5) == 141120.0
  assert roofline.train_flops(cfg, 3, 5, causal=True) == 133920.0


def test_mfu_both_labels_each_convention():
  """Same config: 141120 and 133920 FLOPs in 0.5 s are 282240 and 267840 FLOP/s; against
  a peak of 1e-3 GFLOP/s (1e6 FLOP/s): 0.28224 and 0.26784."""
  cfg = Qwen3Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4)
  mfu = roofline.mfu_both(cfg, 3, 5, 0.5, 1e-3)
  assert mfu == {"full_attention": pytest.approx(0.28224),
                 "causal_attention": pytest.approx(0.26784)}
  assert roofline.mfu_both(cfg, 3, 5, 0.0, 1e-3) == {"full_attention": 0.0,
                                                      "causal_attention": 0.0}


def test_causal_count_is_what_a_causal_kernel_computes():
  """XLA's own count of one layer's attention products, with the upper triangle skipped
  by computing the scores block by block (lower blocks only), against attention_flops'
  causal half: exact on the diagonal blocks' full squares aside. Forward only here, so
  a third of the 3x of fwd + bwd."""
  b, s, h, d = 1, 64, 2, 8
  cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=h, num_key_value_heads=h, head_dim=d)
  q = jnp.ones((b, h, s, d), jnp.float32)

  def full(q, k, v):
    return jnp.einsum("bhst,bhtd->bhsd", jnp.einsum("bhsd,bhtd->bhst", q, k), v)
  xla_full = roofline.xla_cost(jax.jit(full), q, q, q)["flops"]
  assert xla_full == pytest.approx(roofline.attention_flops(cfg, b, s) / 3, rel=1e-6)
  # 4 query blocks of 16, each over the key blocks up to its own: 1+2+3+4 = 10 of 16
  # block pairs; the causal half of 16 block pairs is 8, plus half the 4 diagonal ones.
  n = 16

  def blocked(q, k, v):
    outs = []
    for i in range(s // n):
      qi = q[:, :, i * n:(i + 1) * n]
      kk, vv = k[:, :, :(i + 1) * n], v[:, :, :(i + 1) * n]
      outs.append(jnp.einsum("bhst,bhtd->bhsd", jnp.einsum("bhsd,bhtd->bhst", qi, kk), vv))
    return jnp.concatenate(outs, axis=2)
  xla_blocked = roofline.xla_cost(jax.jit(blocked), q, q, q)["flops"]
  causal = roofline.attention_flops(cfg, b, s, causal=True) / 3
  assert xla_blocked == pytest.approx(causal * 10 / 8, rel=1e-6)
