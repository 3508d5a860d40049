"""Every config section has one owner: the module whose function builds the section's defaults in
configs/base.py is the module whose `validate` dgr2_jax.main runs on it, base.py sets no section
field itself, and where a dataclass mirrors a section (DecodeConfig, Qwen3Config's runtime fields)
the two agree. The decode checks are written once: DecodeConfig and `validate` reject a bad value
with the same message."""

import ast
import dataclasses
import importlib.util
import inspect
import os
import textwrap

import ml_collections
import pytest

from dgr2_jax import main as main_lib
from dgr2_jax.decode import config as decode_config
from dgr2_jax.decode import runtime, sampler, speculative
from dgr2_jax.model import config as model_config
from dgr2_jax.train import dry_run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_base():
  """configs/base.py as a module (config files are loaded by path, not imported)."""
  spec = importlib.util.spec_from_file_location("configs_base", os.path.join(REPO_ROOT, "configs", "base.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def section_builders(base) -> dict:
  """{section: the function get_config() calls to build it} (`c.<section> = module.fn()`)."""
  out = {}
  body = ast.parse(textwrap.dedent(inspect.getsource(base.get_config))).body[0].body
  for st in body:
    if isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Attribute) and isinstance(st.value, ast.Call):
      f = st.value.func
      assert isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name), ast.unparse(st)
      out[st.targets[0].attr] = getattr(base.get_config.__globals__[f.value.id], f.attr)
  return out


def section_validators() -> dict:
  """{section: the validate dgr2_jax.main runs on it}."""
  out = {}
  for names, check in main_lib._section_validators():  # pylint: disable=protected-access
    for name in names.split(", "):
      out[name] = check
  return out


def test_every_section_is_built_and_checked_by_one_module():
  base = load_base()
  config = base.get_config()
  sections = [k for k in config.keys() if isinstance(config[k], ml_collections.ConfigDict)]
  builders, validators = section_builders(base), section_validators()
  assert sorted(builders) == sorted(sections)
  for name in sections:
    build = builders[name]
    assert build.__module__.startswith("dgr2_jax."), f"{name}: defaults set in {build.__module__}"
    assert name in validators, f"config.{name} has no validate in dgr2_jax.main"
    assert validators[name].__module__ == build.__module__, (
        f"config.{name}: defaults in {build.__module__}, checks in {validators[name].__module__}")
    assert config[name].to_dict() == build().to_dict()
    validators[name](config, set())  # the defaults pass their own checks


def test_base_sets_only_the_top_level_fields():
  config = load_base().get_config()
  own = [k for k in config.keys() if not isinstance(config[k], ml_collections.ConfigDict)]
  assert sorted(own) == ["dry_run", "seed", "stage"]


def test_decode_defaults_are_decode_config_fields():
  section = load_base().get_config().decode
  dc = decode_config.DecodeConfig(mask_token_id=0)
  shared = [f.name for f in dataclasses.fields(dc) if f.name in section]
  assert len(shared) >= 11   # every field but the token ids the caller resolves
  for f in shared:
    assert section[f] == getattr(dc, f) and type(section[f]) is type(getattr(dc, f)), f
  assert decode_config.decode_config_from(section, mask_token_id=0) == dc
  # one class, one set of allowed values, wherever the decoders reach them
  assert sampler.DecodeConfig is runtime.DecodeConfig is decode_config.DecodeConfig
  assert sampler.KV_WRITES is main_lib.KV_WRITES is decode_config.KV_WRITES
  assert speculative.MODES is main_lib.DECODE_MODES is decode_config.MODES


def test_model_runtime_defaults_are_qwen3_config_fields():
  section = load_base().get_config().model
  defaults = {f.name: f.default for f in dataclasses.fields(model_config.Qwen3Config)}
  shared = [f for f in model_config.RUNTIME_FIELDS if f in section] + ["rms_norm_eps", "rope_theta"]
  assert len(shared) >= 8
  for f in shared:
    assert section[f] == defaults[f] and type(section[f]) is type(defaults[f]), f


BAD_DECODE = [("block_size", 0), ("max_new_tokens", 100), ("threshold", 1.5), ("temperature", -1.0),
              ("top_p", 0.0), ("steps_per_block", -1), ("steps_per_sync", 0), ("kv_write", "both"),
              ("verify_every", -1), ("shared_prefix", -2), ("weight_dtype", "int8")]


@pytest.mark.parametrize("field,value", BAD_DECODE)
def test_decode_checks_are_written_once(field, value):
  config = ml_collections.ConfigDict({"decode": decode_config.decode_config()})
  config.decode[field] = value
  with pytest.raises(ValueError) as from_config:
    decode_config.validate(config, set())
  with pytest.raises(ValueError) as from_dataclass:
    decode_config.DecodeConfig(mask_token_id=0, **{field: value})
  assert str(from_config.value) == str(from_dataclass.value)
  assert str(from_config.value).startswith(f"config.decode.{field}: ")


def test_decode_section_checks():
  config = ml_collections.ConfigDict({"decode": decode_config.decode_config()})
  del config.decode["steps_per_sync"]   # a field left out has its default
  decode_config.validate(config, set())
  for field, value, msg in (("verify_every", 3, "must be 0 or divide decode.steps_per_sync"),
                            ("mode", "beam", "must be one of"), ("top_k", -1, "must be an int >= 0")):
    bad = ml_collections.ConfigDict({"decode": decode_config.decode_config()})
    bad.decode[field] = value
    with pytest.raises(ValueError, match=f"config.decode.{field}: .*{msg}"):
      decode_config.validate(bad, set())
  with pytest.raises(ValueError, match="needs a mask token"):
    decode_config.DecodeConfig(block_size=4)


@pytest.mark.parametrize("field,value", [("num_devices", -1), ("num_devices", 1.5), ("device_memory_gb", -2.0)])
def test_hardware_checks(field, value):
  dry_run.validate(ml_collections.ConfigDict({"hardware": dry_run.hardware_config()}), set())
  config = ml_collections.ConfigDict({"hardware": {**dry_run.hardware_config().to_dict(), field: value}})
  with pytest.raises(ValueError, match=f"config.hardware.{field}: "):
    dry_run.validate(config, set())
