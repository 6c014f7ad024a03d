r"""One GRPO update on given response lengths, packed micro-batches against padded ones, side by side.

  python -m launch.bench_update --models=arith,100m --lengths=lognormal:128:1024,fixed:4 --rollouts=64 \
      --out=/tmp/bench_update.json

For each model shape and length distribution: B = --rollouts sequences of a --prompt_len-token prompt and a response
drawn from the distribution (`sampling.benchmark.draw_lengths`), random tokens, random advantages. The padded update
runs micro-batches of --micro_rows rows of T = prompt + longest response tokens; the packed one packs the same
sequences into micro-batches of the same --micro_rows x T tokens (`rl.packing`). Both are timed interleaved, the
best of --repeats after a compiling call. Reports seconds, real tokens per second (prompt + response, no padding),
the speedup packed / padded, and the share of the measured matmul rate each reaches (6 x parameters x real tokens,
attention left out). --compare_torch adds plain PyTorch as the anchor: transformers' model on the same weights,
the same clipped GRPO loss with token-mean weights, backward over the same padded micro-batches and one Adam step
(the `parity` extra), timed the same way; reported as ratios to it. Writes --out (JSON) and prints the table.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

from configs.base import algo_config
from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl.packing import Packing
from jaxrl_batch.rl.forward import ModelDefs
from jaxrl_batch.rl.update import update
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling.benchmark import draw_lengths
from jaxrl_batch.sampling.roofline import best_seconds, measure_machine
from launch import list_flags, logs

MODELS = {  # name -> ModelConfig fields
    "arith": dict(vocab_size=32, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, d_ff=512,
                  tie_embeddings=True),  # configs/grpo_arith.py's model
    "100m": dict(vocab_size=32000, d_model=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64,
                 d_ff=2048),
}


def _is_length_dist(spec: str) -> bool:
  """Whether `spec` is a response length distribution `draw_lengths` accepts."""
  try:
    draw_lengths(spec, 1, seed=0)
  except ValueError:
    return False
  return True


flags.DEFINE_list("models", ["arith"], f"Model shapes: {sorted(MODELS)}.")
flags.DEFINE_list("lengths", ["lognormal:128:1024", "fixed:4"], "Response length distributions.")
list_flags.choices("models", sorted(MODELS))
list_flags.check_items("lengths", lambda item: None if _is_length_dist(item) else "is not a length distribution",
                       "'fixed:N' (N >= 1) or 'lognormal:MEAN:MAX' (MEAN > 0, MAX >= 1)", "lognormal:128:1024,fixed:4")
flags.DEFINE_integer("rollouts", 64, "Sequences per update.")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per sequence.")
flags.DEFINE_integer("micro_rows", 8, "Rows per micro-batch (padded), and T x this many tokens per packed one.")
flags.DEFINE_integer("repeats", 3, "Timed runs of each update; the best is kept.")
flags.DEFINE_bool("compare_torch", False, "Also time a plain PyTorch update on the same padded micro-batches.")
flags.DEFINE_string("out", "bench_update.json", "Output JSON path.")
FLAGS = flags.FLAGS


def random_batch(lengths_B: np.ndarray, prompt_len: int, vocab: int, seed: int) -> TrainBatch:
  """B sequences: a full prompt of `prompt_len` tokens, then a response of lengths_B[b] tokens, right-padded."""
  rng = np.random.default_rng(seed)
  b, n = len(lengths_B), int(lengths_B.max())
  response_BxN = np.arange(n)[None, :] < lengths_B[:, None]
  valid = np.concatenate([np.ones((b, prompt_len), bool), response_BxN], axis=1)
  loss_mask = np.concatenate([np.zeros((b, prompt_len), bool), response_BxN], axis=1)
  tokens = np.where(valid, rng.integers(1, vocab, valid.shape), 0).astype(np.int32)
  per_token = lambda x: jnp.asarray(np.where(loss_mask, x, 0.0), jnp.float32)
  logp = per_token(-rng.uniform(0.5, 3.0, valid.shape))
  adv = per_token(rng.normal(size=(b, 1)) * np.ones(valid.shape))
  zeros = jnp.zeros(valid.shape, jnp.float32)
  return TrainBatch(jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(loss_mask), logp, logp, zeros, adv, zeros,
                    zeros)


def torch_update(cfg: ModelConfig, params, batch: TrainBatch, micro_rows: int):
  """A call running one plain PyTorch GRPO update of transformers' model on our weights: per padded micro-batch the
  clipped surrogate (clip 0.2) with token-mean weights over the whole batch, backward; then one Adam step."""
  import torch  # pylint: disable=import-outside-toplevel
  from jaxrl_batch.hf.side_by_side import hf_model  # pylint: disable=import-outside-toplevel
  model = hf_model(cfg, params).train()
  opt = torch.optim.Adam(model.parameters(), lr=1e-4)
  tokens, valid, mask, old_logp, adv = (torch.as_tensor(np.asarray(x)) for x in (
      batch.tokens_BxT, batch.valid_BxT, batch.loss_mask_BxT, batch.old_logp_BxT, batch.adv_BxT))
  tokens, valid, mask = tokens.long(), valid.long(), mask.float()
  weights = mask / mask.sum()

  def call():
    opt.zero_grad()
    for i in range(0, tokens.shape[0], micro_rows):
      rows = slice(i, i + micro_rows)
      logits = model(input_ids=tokens[rows], attention_mask=valid[rows]).logits[:, :-1].float()
      logp = torch.log_softmax(logits, -1).gather(-1, tokens[rows, 1:, None])[..., 0]
      ratio = torch.exp(logp - old_logp[rows, 1:])
      a = adv[rows, 1:]
      loss = -(torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a) * weights[rows, 1:]).sum()
      loss.backward()
    opt.step()
    return loss
  return call


def measure(model: str, lengths: str, machine: dict) -> dict:
  cfg = ModelConfig(**MODELS[model])
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params = sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  tx = optax.adam(1e-4)
  models, algo = ModelDefs(graphdef, tx), algo_config()
  lengths_B = draw_lengths(lengths, FLAGS.rollouts, seed=0)
  batch = random_batch(lengths_B, FLAGS.prompt_len, cfg.vocab_size, seed=1)
  t = batch.tokens_BxT.shape[1]
  packing = Packing(FLAGS.micro_rows, t)
  state = dict(params=params, opt_state=tx.init(params))

  def run(packing_):
    held = [jax.tree.map(jnp.copy, state)]  # the update donates its state: each call takes the last one's

    def call():
      held[0], metrics = update(held[0], batch, jnp.float32(0), models=models, cfg=algo,
                                num_micro=FLAGS.rollouts // FLAGS.micro_rows, packing=packing_)
      return metrics["loss"]
    return call

  with jax.set_mesh(mesh):
    padded_s, packed_s = best_seconds([run(None), run(packing)], FLAGS.repeats)
  tokens = int(FLAGS.rollouts * FLAGS.prompt_len + lengths_B.sum())
  flops = 6 * cfg.num_params() * tokens
  out = dict(model=model, params=cfg.num_params(), lengths=lengths, rollouts=FLAGS.rollouts, row_tokens=t,
             real_tokens=tokens, padded_tokens=FLAGS.rollouts * t, response_len_mean=float(lengths_B.mean()),
             response_len_max=int(lengths_B.max()), padded_s=padded_s, packed_s=packed_s,
             speedup=padded_s / packed_s)
  kinds = ["padded", "packed"]
  if FLAGS.compare_torch:
    out["torch_padded_s"], = best_seconds([torch_update(cfg, params, batch, FLAGS.micro_rows)], FLAGS.repeats)
    out.update(padded_vs_torch=out["torch_padded_s"] / padded_s, packed_vs_torch=out["torch_padded_s"] / packed_s)
    kinds.append("torch_padded")
  for kind in kinds:
    seconds = out[f"{kind}_s"]
    out[f"{kind}_tokens_per_s"] = tokens / seconds
    out[f"{kind}_matmul_frac"] = flops / seconds / machine["matmul_flops_per_s"]
  return out


def main(argv):
  del argv
  logs.setup()
  machine = measure_machine(jnp.float32, bandwidth_mb=64, matmul_size=1024)
  results = [measure(model, lengths, machine) for model in FLAGS.models for lengths in FLAGS.lengths]
  report = dict(devices=str(jax.devices()), matmul_flops_per_s=machine["matmul_flops_per_s"],
                micro_rows=FLAGS.micro_rows, prompt_len=FLAGS.prompt_len, results=results)
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=2)
  lines = [f"{'model':>6} {'lengths':>20} {'mean':>6} {'T':>5} {'padded s':>9} {'packed s':>9} {'speedup':>8} "
           f"{'padded tok/s':>13} {'packed tok/s':>13} {'padded mm%':>10} {'packed mm%':>10}"]
  lines += [f"{r['model']:>6} {r['lengths']:>20} {r['response_len_mean']:>6.1f} {r['row_tokens']:>5} "
            f"{r['padded_s']:>9.3f} {r['packed_s']:>9.3f} {r['speedup']:>8.2f} {r['padded_tokens_per_s']:>13.0f} "
            f"{r['packed_tokens_per_s']:>13.0f} {100 * r['padded_matmul_frac']:>10.1f} "
            f"{100 * r['packed_matmul_frac']:>10.1f}" + (
                f"   torch padded {r['torch_padded_s']:.3f} s: jax padded {r['padded_vs_torch']:.2f}x, packed "
                f"{r['packed_vs_torch']:.2f}x its speed" if "torch_padded_s" in r else "") for r in results]
  logging.info("Matmul rate %.1f GFLOP/s. Wrote %s\n%s", machine["matmul_flops_per_s"] / 1e9, FLAGS.out,
               "\n".join(lines))


if __name__ == "__main__":
  app.run(main)
