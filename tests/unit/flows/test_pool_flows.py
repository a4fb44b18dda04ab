"""The work-pool deployments' `config` field (flows/pool_flows.py): a name in configs/ or a path; anything
else is one paragraph that names the field, the value and the names there are."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_core.config import ConfigError
from flows.pool_flows import config_file

ROOT = Path(__file__).resolve().parents[3]


def test_a_name_in_configs_or_a_path(tmp_path):
    assert config_file("tiny_cpu") == ROOT / "configs" / "tiny_cpu.yaml"
    assert config_file("dapo_qwen2.5_32b.yaml") == ROOT / "configs" / "dapo_qwen2.5_32b.yaml"
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: dapo.yaml\n")
    assert config_file(str(mine)) == mine


def test_an_unknown_name_is_one_paragraph_with_the_fix():
    with pytest.raises(ConfigError) as e:
        config_file("tiny-cpu")
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("config='tiny-cpu': no such file, and no configs/tiny-cpu.yaml;")
    assert "deployment's `config` field" in text and "tiny_cpu" in text and "smollm2_cpu" in text
