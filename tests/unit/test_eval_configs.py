"""`cai-dllm eval`'s default rows: every family's rows are valid requests for that family's decoding
mode (its policies serve the mode), so `cai-dllm eval --model DIR` runs on any served checkpoint."""

from __future__ import annotations

import pytest

from engine.decoding import DecodeParams
from engine.decoding.registry import POLICIES
from engine.models.registry import FAMILIES
from tinymodels.evaluate import default_configs


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_every_familys_default_rows_are_requests_its_mode_serves(architecture):
    mode = FAMILIES[architecture].mode
    configs = default_configs(architecture)
    assert configs and len({c.name for c in configs}) == len(configs)
    for config in configs:
        params = DecodeParams.from_dict(config.params)
        assert mode in POLICIES[params.policy].modes, (config.name, params.policy, mode)
