"""Every shipped config builds (default and debug), each sweep member derives as launch.study builds it, config
args are parsed strictly, and the mixture-of-experts members have the shapes they claim (they train in
tests/test_router_stats.py)."""
import dataclasses
import glob
import importlib
import json
import math
import os

import jax
import pytest

from configs import grpo_arith, grpo_gsm8k_qwen
from jaxrl_batch.config import migrate
from jaxrl_batch.config.args import apply_overrides, parse_arg
from jaxrl_batch.config.optim import make_optimizer
from jaxrl_batch.model import ModelConfig
from jaxrl_batch.model.lora import LoRAConfig
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling.engine_settings import EngineSettings
from jaxrl_batch.sampling.strategies import Strategy
from jaxrl_batch.study import runner
from jaxrl_batch.train import rundir
from jaxrl_batch.train.evaluation import EvalConfig
from jaxrl_batch.train.setup import Experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = jax.devices()[:1]
# Every config file but base.py (the recipe they share, not a config of its own).
CONFIGS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if os.path.basename(p) not in ("__init__.py", "base.py"))
SWEEP_BASE_ARG = {"grpo_gsm8k_qwen": "model=qwen2.5-0.5b"}  # The model its sweep() is for (tiny_random: 64 samples).


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_builds_and_its_sweep_members_derive(name):
  module = importlib.import_module(f"configs.{name}")
  for arg in [None, "debug"]:
    config = module.get_config(arg)
    config.mesh.data = 1
    exp = Experiment.create(config, devices=jax.devices()[:1])
    optimizer = make_optimizer(config.optim, config.batch_size, config.sample_budget)
    assert optimizer.lr.lr > 0
    assert exp.prompt_len > 1 and exp.response_len > 1
  # A sweep member is built as launch.study builds it; its Member validates (a Qwen model needs its tokenizer for
  # a whole Experiment).
  members = [runner.derive(runner.member_config(module, SWEEP_BASE_ARG.get(name, ""), dict(f, seed=0)), f, ONE)
             for f in module.sweep()]
  assert len({m.name for m in members}) == len(members) and len({m.sample_budget for m in members}) == 1


@pytest.mark.parametrize("name", CONFIGS)
def test_sweep_members_follow_their_rule(name):
  module = importlib.import_module(f"configs.{name}")
  for fields in module.sweep():
    c = runner.member_config(module, SWEEP_BASE_ARG.get(name, ""), fields)
    lr = make_optimizer(c.optim, c.batch_size, c.sample_budget).lr.lr
    ratio = c.batch_size / c.optim.base_batch
    want = c.optim.base_lr * {"sqrt": math.sqrt(ratio), "none": 1.0, "linear": ratio}[c.optim.lr_rule]
    assert (c.batch_size, c.optim.lr_rule, lr) == (fields["batch"], fields["lr_rule"], pytest.approx(want))


def _shipped_configs():
  """Every shipped config file at its default member, its debug member, and (the Qwen recipe) every model."""
  for name in CONFIGS:
    module = importlib.import_module(f"configs.{name}")
    args = [f"model={m}" for m in module.MODELS] if name == "grpo_gsm8k_qwen" else [None, "debug", "moe"]
    for arg in args:
      yield f"{name}:{arg}", module.get_config(arg)


def test_every_field_of_the_groups_dataclasses_is_in_every_shipped_config_and_settable():
  """`--config.<group>.<field>=` reaches every field of the dataclass a group is read into."""
  groups = dict(model=[ModelConfig], lora=[LoRAConfig], sampling=[Strategy, EngineSettings], eval=[EvalConfig])
  for name, config in _shipped_configs():
    for group, classes in groups.items():
      fields = {f.name for cls in classes for f in dataclasses.fields(cls)}
      assert set(config[group]) == fields, (name, group, fields ^ set(config[group]))
  config = grpo_gsm8k_qwen.get_config("model=qwen3-30b-a3b")
  apply_overrides(config, ["model.moe_chunk=8192", "model.attention=splash", "model.routing_replay=True",
                           "model.mlp_only_layers=0, 47"])
  cfg = ModelConfig.from_config(config.model)
  assert (cfg.moe_chunk, cfg.attention, cfg.routing_replay, cfg.mlp_only_layers) == (8192, "splash", True, (0, 47))


def test_model_fields_a_saved_config_lacks_are_filled_with_the_defaults_its_run_took():
  """Runs written when the recipes left model fields out built them with ModelConfig's defaults, which are still
  today's: a changed default keeps its old value in migrate.ADDED, and this test with it."""
  filled = migrate.complete({"model": {}})["model"]
  defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in filled}))
  assert {"attention", "moe_chunk", "routing_replay", "mlp_only_layers", "dtype"} <= set(filled)
  assert filled == {key: defaults[key] for key in filled}
  old = json.loads(grpo_gsm8k_qwen.get_config("model=tiny_random").to_json())
  for key in filled:
    old["model"].pop(key)
  old["model"].update(qkv_bias=True)  # The one of them the tiny model's entry listed.
  new = json.loads(grpo_gsm8k_qwen.get_config("model=tiny_random").to_json())
  assert rundir.config_diff(migrate.complete(old), new) == []


def test_parse_arg_types_and_errors():
  c = parse_arg("batch=256,lr_rule=none,debug", batch=128, lr_rule="sqrt", debug=False, scale=1.0)
  assert (c.batch, c.lr_rule, c.debug, c.scale) == (256, "none", True, 1.0)
  assert parse_arg("scale=2.5,debug=false", scale=1.0, debug=True).to_dict() == {"scale": 2.5, "debug": False}
  with pytest.raises(ValueError, match="Unknown config arg 'bach'; this config accepts"):
    parse_arg("bach=3", batch=128)
  with pytest.raises(ValueError, match="batch='x': expected int"):
    parse_arg("batch=x", batch=128)
  with pytest.raises(ValueError, match="needs a value"):
    parse_arg("batch", batch=128)
  c = grpo_arith.get_config("debug")
  apply_overrides(c, ["writers=jsonl, tensorboard"])  # launch.study --set: a tuple field takes comma-separated names.
  assert c.writers == ("jsonl", "tensorboard")


def _model(module, arg=None) -> ModelConfig:
  return ModelConfig.from_config(module.get_config(arg).model)


@pytest.mark.parametrize("debug", ["", "debug,"])
def test_arith_moe_member_has_the_dense_members_active_parameters(debug):
  dense, moe = _model(grpo_arith, debug), _model(grpo_arith, debug + "moe")
  assert moe.num_experts > moe.num_experts_per_tok > 1 and moe.moe_layers == tuple(range(moe.num_layers))
  # A token's MLP work is the dense model's; only the D x E routers are extra (0.4%; 2.5% of the 1-layer debug model).
  assert moe.num_params(active=True) - dense.num_params() == moe.num_layers * moe.d_model * moe.num_experts
  assert moe.num_params(active=True) == pytest.approx(dense.num_params(), rel=0.03)
  idle = moe.num_layers * (moe.num_experts - moe.num_experts_per_tok) * 3 * moe.d_model * moe.moe_d_ff
  assert moe.num_params() - moe.num_params(active=True) == idle
  # Everything but the model is the dense member's recipe.
  def recipe(arg):
    return {k: v for k, v in grpo_arith.get_config(arg).to_dict().items() if k != "model"}
  assert recipe(debug + "moe") == recipe(debug)
  exp = Experiment.create(grpo_arith.get_config(debug + "moe"), devices=ONE)
  _, params = exp.init_params(seed=0)
  assert sum(x.size for x in jax.tree.leaves(params)) == moe.num_params()


def test_qwen_moe_models():
  big = _model(grpo_gsm8k_qwen, "model=qwen3-30b-a3b")
  # Qwen3-30B-A3B: 30.5B parameters, 3.3B active.
  assert (big.num_params(), big.num_params(active=True)) == (30_532_122_624, 3_353_032_704)
  assert (big.num_experts, big.num_experts_per_tok, big.moe_d_ff, big.qk_norm, big.tie_embeddings) == (
      128, 8, 768, True, False)
  family = grpo_gsm8k_qwen.get_config("model=qwen3-30b-a3b")
  assert (family.batch_size, family.group_size, family.optim.base_lr, family.optim.lr_rule) == (1024, 8, 1e-6, "sqrt")
  assert family.mesh.to_dict() == dict(data=1, fsdp=-1, tensor=1, expert=8)
  # The reference study's recipe: 8,192-token responses, float32 master weights under bfloat16 compute.
  assert (family.task.max_response_tokens, big.param_dtype, big.dtype) == (8192, "float32", "bfloat16")
  tiny, dense = _model(grpo_gsm8k_qwen, "model=tiny_moe"), _model(grpo_gsm8k_qwen, "model=tiny_random")
  # Its MLPs: a token's k experts are as wide as tiny_random's SwiGLU.
  assert tiny.moe_layers == (0, 1) and tiny.num_experts_per_tok * tiny.moe_d_ff == dense.d_ff
  exp = Experiment.create(grpo_gsm8k_qwen.get_config("model=tiny_moe"), devices=ONE)
  assert exp.tokenizer.path == grpo_gsm8k_qwen.SAMPLE_TOKENIZER and exp.model_cfg == tiny


@pytest.mark.parametrize("arg, sizes", [
    ("mesh=1x-1x1", (1, -1, 1, 1)), ("mesh=2x4x1", (2, 4, 1, 1)), ("mesh=1x-1x1x8", (1, -1, 1, 8)),
    ("model=qwen2.5-7b", (-1, 1, 1, 1))])
def test_gsm8k_mesh_arg_takes_an_optional_expert_factor(arg, sizes):
  mesh = grpo_gsm8k_qwen.get_config(arg).mesh
  assert (mesh.data, mesh.fsdp, mesh.tensor, mesh.expert) == sizes


def test_mesh_with_expert_axis_and_bad_mesh_args():
  mesh = sharding.make_mesh(**grpo_gsm8k_qwen.get_config("mesh=1x-1x1x4").mesh)
  assert dict(mesh.shape) == dict(data=1, fsdp=2, expert=4, tensor=1)
  assert dict(sharding.make_mesh(**grpo_arith.get_config().mesh).shape) == dict(data=8, fsdp=1, expert=1, tensor=1)
  with pytest.raises(ValueError, match="write dataxfsdpxtensor"):
    grpo_gsm8k_qwen.get_config("mesh=1x8")
  with pytest.raises(ValueError, match="must be an integer"):
    grpo_gsm8k_qwen.get_config("mesh=1xax1")


def test_mesh_sizes_take_an_optional_expert_size_in_either_spelling():
  assert sharding.mesh_sizes("1x-1x1") == dict(data=1, fsdp=-1, tensor=1, expert=1)
  assert sharding.mesh_sizes("1,-1,1,8", sep=",") == dict(data=1, fsdp=-1, tensor=1, expert=8)
  with pytest.raises(ValueError, match="write data,fsdp,tensor"):
    sharding.mesh_sizes("1,8", sep=",")


def test_a_config_that_lacks_fields_of_the_recipe_is_refused_naming_them():
  c = grpo_arith.get_config("debug")
  del c["chat_template"]
  del c.rl["noise_split"]
  with pytest.raises(ValueError, match=r"lacks chat_template, rl.noise_split, .*configs/base.get_config"):
    Experiment.create(c, devices=jax.devices()[:1])
