"""PipelineBase: what a pipeline must provide, refused at construction; the shared config checks."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from ardiff_jax.models import CFGPipelineConfig, FewStepSchedule, WorldPipeline, WorldPipelineConfig
from ardiff_jax.models._common import DiTModules, PipelineBase, PipelineSession


@pytest.fixture
def no_weights(monkeypatch):
    """Weights are the last step of construction: reaching it means every contract check passed."""

    def reached(cls, config, seed):
        raise AssertionError("reached weight construction")

    monkeypatch.setattr(DiTModules, "create", classmethod(reached))


class _Complete(PipelineBase):
    pipeline_config_type = WorldPipelineConfig
    session_type = PipelineSession
    kv_spec_for = staticmethod(WorldPipeline.kv_spec_for)

    def validate_ar_diffusion_request(self, session_id, request):
        return None

    def forward(self, request):
        return self._bound_state()


class _NoSpec(PipelineBase):
    pipeline_config_type = WorldPipelineConfig
    session_type = PipelineSession

    def validate_ar_diffusion_request(self, session_id, request):
        return None

    def forward(self, request):
        return self._bound_state()


class _NoValidator(_Complete):
    validate_ar_diffusion_request = PipelineBase.validate_ar_diffusion_request


class _NoSessionType(_Complete):
    session_type = None


class _WrongConfigType(_Complete):
    pipeline_config_type = dict


class _NoAttributes(PipelineBase):
    kv_spec_for = staticmethod(WorldPipeline.kv_spec_for)

    def validate_ar_diffusion_request(self, session_id, request):
        return None

    def forward(self, request):
        return None


@pytest.mark.parametrize("cls, message", [
    (_NoSpec, "abstract method.*kv_spec_for"),
    (_NoValidator, "abstract method.*validate_ar_diffusion_request"),
    (_NoSessionType, "_NoSessionType must set the class attribute.*session_type"),
    (_WrongConfigType, "pipeline_config_type \\(a PipelineConfigBase subclass\\)"),
    (_NoAttributes, "pipeline_config_type .* session_type"),
])
def test_a_subclass_missing_a_piece_fails_at_construction(cls, message, no_weights):
    with pytest.raises(TypeError, match=message):
        cls("tiny")


def test_a_complete_subclass_passes_the_checks(no_weights):
    with pytest.raises(AssertionError, match="reached weight construction"):
        _Complete("tiny")
    with pytest.raises(TypeError, match="pipeline_config must be a WorldPipelineConfig, got CFGPipelineConfig"):
        _Complete("tiny", CFGPipelineConfig())


@pytest.mark.parametrize("config_cls", [WorldPipelineConfig, CFGPipelineConfig])
@pytest.mark.parametrize("field, value, message", [
    ("session_capacity", 0, "session_capacity must be a positive integer"),
    ("session_capacity", True, "session_capacity must be a positive integer"),
    ("session_capacity", 2.0, "session_capacity must be a positive integer"),
    ("weights_seed", -1, "weights_seed must be a non-negative integer"),
    ("noise_seed", "0", "noise_seed must be a non-negative integer"),
])
def test_pipeline_configs_share_the_policy_checks(config_cls, field, value, message):
    with pytest.raises(ValueError, match=f"{config_cls.__name__} {message}"):
        config_cls(**{field: value})
    with pytest.raises(TypeError, match="schedule must be a FewStepSchedule"):
        config_cls(schedule=(1000.0, 500.0))
    assert config_cls(session_capacity=np.int64(2), schedule=FewStepSchedule((1000.0, 500.0))).session_capacity == 2


@pytest.mark.parametrize("field, value, message", [
    ("num_state_tokens", 0, "num_state_tokens must be a positive integer"),
    ("action_dim", False, "action_dim must be a positive integer"),
    ("guidance_scale", float("nan"), "guidance_scale must be a finite number"),
    ("guidance_scale", "5", "guidance_scale must be a finite number"),
    ("negative_prompt", None, "negative_prompt must be a string"),
])
def test_cfg_config_checks_its_own_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        CFGPipelineConfig(**{field: value})


# -- layers -------------------------------------------------------------------------------------

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ardiff_jax"
# envs is a bottom layer too (it imports only _checks; test_architecture checks that), and so are the
# bounded file readers (_files, _checkpoint_files: the standard library, numpy and each other only).
MODELS_MAY_IMPORT = {"ardiff_jax.kv", "ardiff_jax.types", "ardiff_jax.capability", "ardiff_jax._checks", "ardiff_jax.envs",
                     "ardiff_jax._files", "ardiff_jax._checkpoint_files"}


def _imported_modules(path: pathlib.Path) -> list[tuple[str, bool]]:
    """``(module, only_for_type_checking)`` of every absolute ``ardiff_jax`` import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_checking = {id(node) for block in ast.walk(tree)
                     if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                     for stmt in block.body for node in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, id(node) in type_checking) for name in names if name.split(".")[0] == "ardiff_jax"]
    return found


def test_models_import_only_public_lower_layers():
    offenders = []
    for path in sorted((PACKAGE / "models").glob("*.py")):
        for module, type_only in _imported_modules(path):
            if module.startswith("ardiff_jax.models") or module in MODELS_MAY_IMPORT:
                continue
            if module == "ardiff_jax.runtime" and type_only:
                continue
            offenders.append((path.name, module))
    assert offenders == []


def test_cli_uses_public_runtime_names():
    modules = {module for module, _ in _imported_modules(PACKAGE / "cli.py")}
    assert not any(module.startswith("ardiff_jax.runtime._") for module in modules), modules
    assert not any(module.startswith("ardiff_jax.models._") for module in modules), modules
