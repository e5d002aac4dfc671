"""`onceflow flower` runs with ./flower.cfg when there is one, else the package's own settings
(a wheel install has no repository, so no root flower.cfg)."""

from __future__ import annotations

from pathlib import Path

from onceflow.cli.commands_processes import flower_conf_path
from tests.conftest import ROOT


def test_the_working_directorys_flower_cfg_else_the_packages(tmp_path: Path) -> None:
    packaged = flower_conf_path(None, cwd=tmp_path)
    assert packaged.name == "flower_conf.py" and packaged.parent.name == "onceflow"
    assert "basic_auth_from_env" in packaged.read_text()
    (tmp_path / "flower.cfg").write_text("port = 5566\n")
    assert flower_conf_path(None, cwd=tmp_path) == tmp_path / "flower.cfg"
    assert flower_conf_path("elsewhere.cfg", cwd=tmp_path) == Path("elsewhere.cfg")


def test_the_template_starts_from_the_packages_settings() -> None:
    # The repository's flower.cfg is a template: onceflow's settings, then the user's.
    assert "from onceflow.flower_conf import *" in (ROOT / "flower.cfg").read_text()
