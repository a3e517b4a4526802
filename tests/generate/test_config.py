"""GenerateConfig and EngineSpec: the command line parsed once, the Namespace left as argparse made it."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from rollshard.generate.arguments import build_parser
from rollshard.generate.config import GenerateConfig
from rollshard.generate.engines import EngineSpec
from rollshard.generate.resume import ExistingDataset
from rollshard.store.common import UsageError


def test_engine_spec_parses_each_kind():
    spec = EngineSpec.parse(" embedded:models/tiny@cuda:1 ")
    assert (spec.embedded, spec.model, spec.device, spec.urls) == (True, "models/tiny", "cuda:1", ())
    assert spec.text == " embedded:models/tiny@cuda:1 "  # as given: the run config records it unchanged
    assert EngineSpec.parse("embedded:m").device is None
    spec = EngineSpec.parse("http://a:1, https://b:2,")
    assert (spec.embedded, spec.model, spec.urls) == (False, None, ("http://a:1", "https://b:2"))
    with pytest.raises(ValueError, match="needs a model folder"):
        EngineSpec.parse("embedded:")
    for bad in ("ftp://x", "", "http://a,b"):
        with pytest.raises(ValueError, match="neither 'embedded:PATH' nor a comma-separated list"):
            EngineSpec.parse(bad)


def config_of(tmp_path, *argv):
    args = build_parser().parse_args(["--out", str(tmp_path / "ds"), *argv])
    before = copy.deepcopy(vars(args))
    config = GenerateConfig.from_args(args, ExistingDataset.open(str(tmp_path / "ds")))
    assert vars(args) == before  # nothing assigned onto the Namespace
    return config


def test_the_config_resolves_what_depends_on_other_flags(tmp_path):
    config = config_of(tmp_path, "--engine", "embedded:m", "--top-p", "0.9", "--stop", "x")
    assert (config.shard_index, config.num_shards) == (0, 1)
    assert config.return_sampling_mask  # auto: top-p truncates
    assert config.sampling_params().stop == ["x"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    # --ray without --num-shards: one task per server.
    config = config_of(tmp_path, "--engine", "http://a:1,http://b:2", "--ray", "--top-k", "5")
    assert config.ray_driver and (config.shard_index, config.num_shards) == (0, 2)


def test_a_bad_engine_spec_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot start engine 'ftp://x': engine spec 'ftp://x' is neither"):
        config_of(tmp_path, "--engine", "ftp://x")
