"""One process of the multi-process tests (tests/test_multihost.py runs it).

  python tests/multihost_worker.py --out DIR [--num_processes 2 --process_id I --port P]
                                   [--restore CKPT_DIR] [--compile_cache DIR]

On the (data 2, fsdp 2, tensor 2) mesh over every device of the job: one sharded
GRPO train step of a tiny Qwen3 from a fixed batch, once with SGD at learning rate 1
(new params = params - gradients: the gradients themselves) and once with AdamW (the
real update). Writes from process 0 `DIR/result.npz` (loss, gradients, new params);
every process saves the AdamW state as an orbax checkpoint in `DIR/ckpt`, and the
HF export of it in `DIR/hf`. With --restore, the checkpoint there is restored onto
this job's mesh, stored as `restored_*` in the npz and exported to `DIR/hf_restored`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--num_processes", type=int, default=1)
  ap.add_argument("--process_id", type=int, default=0)
  ap.add_argument("--port", type=int, default=0)
  ap.add_argument("--restore", default="")
  ap.add_argument("--compile_cache", default="")
  a = ap.parse_args()
  if a.compile_cache:   # the jobs of one process count compile the same programs
    from rstar_jax import compile_cache
    compile_cache.enable(a.compile_cache)

  from rstar_jax import distributed
  if a.num_processes > 1:
    distributed.initialize(distributed.DistributedConfig(
        coordinator_address=f"127.0.0.1:{a.port}", num_processes=a.num_processes,
        process_id=a.process_id, initialization_timeout_s=120))
  import jax
  import numpy as np
  import optax
  from flax import nnx

  from rstar_jax import checkpoint, optim, sharding
  from rstar_jax.model import model_config, hf_io, qwen3
  from rstar_jax.rl import batching, losses, train_step as ts
  from rstar_jax.train import step as core

  assert jax.device_count() == 8, jax.devices()
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  cfg = model_config.get_preset("tiny", hidden_size=64, intermediate_size=128, head_dim=16,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256)
  rng = np.random.RandomState(0)
  trajs = [batching.TokenTrajectory(
      prompt_ids=rng.randint(0, 256, 8).tolist(), response_ids=rng.randint(0, 256, n).tolist(),
      response_mask=[1] * n, response_logprobs=(-rng.rand(n) * 2).tolist())
      for n in (20, 13, 24, 9, 17, 24, 5, 11)]
  batch = batching.build_batch(trajs, rng.randn(8).astype(np.float32), row_multiple=4,
                               length_multiple=8)
  step_cfg = core.StepConfig(micro_batches=2, logprob_chunk=16)

  def run(tx):
    model = qwen3.create_model(cfg, seed=0)
    graphdef, state, shard = core.init_train_state(model, tx, mesh)
    step = ts.make_train_step(graphdef, tx, losses.LossConfig(), step_cfg, mesh=mesh,
                              state_shardings=shard, donate=False)
    new, m = step(state, batch)
    return graphdef, state, new, m, shard

  def flat(params):
    return {jax.tree_util.keystr(p): distributed.host_value(v)
            for p, v in jax.tree_util.tree_leaves_with_path(params)}

  _, s0, s_sgd, _, _ = run(optax.sgd(1.0))
  grads = {k: p0 - p1 for (k, p0), p1 in zip(flat(s0.params).items(),
                                               flat(s_sgd.params).values())}
  adamw = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
  graphdef, _, state, m, shard = run(adamw)
  out = {"loss": distributed.host_value(m["loss"]),
         **{f"grad{k}": v for k, v in grads.items()},
         **{f"param{k}": v for k, v in flat(state.params).items()}}

  ckpt = checkpoint.Checkpointer(os.path.join(a.out, "ckpt"))
  ckpt.save(1, state, {"step": 1})
  ckpt.close()
  hf_io.save_hf(nnx.merge(graphdef, state.params), os.path.join(a.out, "hf"), dtype="float32")
  if a.restore:
    other = checkpoint.Checkpointer(a.restore)
    restored, meta = other.restore(state, shard)
    other.close()
    assert meta == {"step": 1}, meta
    out.update({f"restored_param{k}": v for k, v in flat(restored.params).items()})
    out.update({f"restored_opt{k}": v for k, v in flat(restored.opt_state).items()})
    hf_io.save_hf(nnx.merge(graphdef, restored.params), os.path.join(a.out, "hf_restored"),
                  dtype="float32")
  out.update({f"opt{k}": v for k, v in flat(state.opt_state).items()})
  if distributed.is_main():
    np.savez(os.path.join(a.out, "result.npz"), **out)
  distributed.barrier("worker done")


if __name__ == "__main__":
  main()
