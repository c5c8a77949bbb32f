"""``to_yaml`` writes the bytes OmegaConf would: config.yaml and its recorded sha256 do not change.

``to_yaml`` walks the dataclasses itself (5x faster than building the OmegaConf tree); these
tests hold it to ``OmegaConf.to_yaml(OmegaConf.structured(cfg))`` on every shipped experiment,
with the values most likely to differ: enums in lists, an integer for a float, strings that
read as other types, free-form mappings, ``null``.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from fsdp_workflow.config import compose
from fsdp_workflow.config.load import CONF_DIR, load_run_config, to_yaml

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
AWKWARD = ["train.report_to=[tensorboard,mlflow]", "optimizer.lr=1", "name='1.0'", "+cluster.nccl_env.X='true'",
           "+model.extra_config.rope_theta=10000", "+model.extra_config.flag=null",
           "+cluster.additional_parameters={a: 'yes', b: '3'}"]


def _omegaconf_yaml(cfg) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("extra", [[], AWKWARD], ids=["as shipped", "awkward values"])
def test_the_bytes_are_omegaconfs(experiment: str, extra: list[str]) -> None:
    cfg = compose([f"+experiment={experiment}", *extra])
    assert to_yaml(cfg) == _omegaconf_yaml(cfg)


def test_a_hand_set_integer_for_a_float_is_written_as_omegaconf_writes_it(tmp_path) -> None:
    cfg = compose(["+experiment=smoke"])
    cfg.optimizer.lr = 1  # type: ignore[assignment]  (a float field given an int by Python code)
    text = to_yaml(cfg)
    assert text == _omegaconf_yaml(cfg) and "lr: 1.0\n" in text
    (tmp_path / "config.yaml").write_text(text)
    assert load_run_config(tmp_path).optimizer.lr == 1.0  # and it reads back
