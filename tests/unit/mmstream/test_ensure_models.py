"""`mmstream up` checks the models of every registered modality and the language model."""

from __future__ import annotations

import pytest

from mmstream import commands
from schemas.settings import Settings


def test_every_registered_modality_s_model_is_checked_once(memo, monkeypatch, tmp_path) -> None:
    asked: list[str] = []
    monkeypatch.setattr(commands.ModelRepository, "resolve", lambda self, name, version=None: asked.append(name))
    commands._ensure_models(Settings.from_env({"MMSTREAM_MODELS_REPOSITORY": str(tmp_path)}))
    assert asked == ["all-minilm-l6-v2", "efficientnet-lite0", "whisper-base", "memo-model", "smollm2-135m"]


def test_a_missing_model_is_one_sentence_saying_what_to_run(tmp_path) -> None:
    with pytest.raises(commands.UserError, match="mmstream models build"):
        commands._ensure_models(Settings.from_env({"MMSTREAM_MODELS_REPOSITORY": str(tmp_path)}))
