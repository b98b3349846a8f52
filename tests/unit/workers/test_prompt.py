"""Prompt builder: the documented format, label filtering, and no chat-turn injection."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.prompt import (
    CONTROL_MARKERS,
    AudioPart,
    FrameLabels,
    ImagePart,
    Label,
    PromptSettings,
    TextPart,
    VideoPart,
    build_messages,
    build_prompt,
    render_chatml,
)


def user(parts, **settings) -> str:
    return build_messages(parts, PromptSettings(**settings))[-1]["content"]


def test_documented_format() -> None:
    parts = [
        ImagePart([Label("tiger cat", 0.10), Label("tabby cat", 0.82), Label("Egyptian cat", 0.05),
                   Label("lynx", 0.01)]),
        AudioPart("turn left   at the\nnext corner"),
        VideoPart([FrameLabels(2.0, [Label("sandbar", 0.64)]),
                   FrameLabels(0.0, [Label("beach", 0.71), Label("seashore", 0.20)])],
                  transcript="the waves are high today"),
        TextPart("What is in the picture?"),
    ]
    assert user(parts) == (
        "[image 1] labels: tabby cat 0.82, tiger cat 0.10, Egyptian cat 0.05\n\n"
        '[audio 1] transcript: "turn left at the next corner"\n\n'
        "[video 1] frames: 0.0 s: beach 0.71, seashore 0.20 | 2.0 s: sandbar 0.64\n"
        '[video 1] transcript: "the waves are high today"\n\n'
        "What is in the picture?"
    )


def test_chatml_rendering() -> None:
    prompt = build_prompt([TextPart("What is the capital of France?")], PromptSettings(system="Be brief."))
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError):
        render_chatml([{"role": "user", "content": "x"}])


def test_numbering_failures_and_empty_results() -> None:
    parts = [ImagePart([Label("dog", 0.01)]), ImagePart(failed=True), AudioPart(""),
             VideoPart(), AudioPart(failed=True)]
    assert user(parts) == (
        "[image 1] labels: (no confident labels)\n\n[image 2] (unavailable)\n\n"
        '[audio 1] transcript: (no speech)\n\n[video 1] frames: (none)\n\n[audio 2] (unavailable)'
    )


def test_limits_on_labels_frames_and_transcripts() -> None:
    frames = [FrameLabels(float(i), [Label(f"l{i}", 0.5)]) for i in range(10)]
    text = user([VideoPart(frames, transcript="x" * 50)], max_frames=2, max_transcript_chars=10)
    assert text.count(" s: ") == 2 and "0.0 s" in text and "5.0 s" in text
    assert '"xxxxxxxxxx…"' in text
    assert user([ImagePart([Label(str(i), 0.9 - i / 100) for i in range(9)])], max_labels=2).endswith("0 0.90, 1 0.89")


def test_history_sits_between_system_and_user() -> None:
    history = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})
    roles = [m["role"] for m in build_messages([TextPart("again")], PromptSettings(history=history))]
    assert roles == ["system", "user", "assistant", "user"]


def test_errors() -> None:
    with pytest.raises(ValueError):
        build_messages([])
    with pytest.raises(ValueError):
        build_messages(["not a part"])  # type: ignore[list-item]


@given(st.lists(st.sampled_from(["a", "<|", "im_start", "im_end", "|>", "endoftext", "\n"]), max_size=30))
def test_untrusted_content_cannot_open_a_turn(pieces: list[str]) -> None:
    hostile = "".join(pieces)
    parts = [TextPart(hostile), ImagePart([Label(hostile, 0.9)]), AudioPart(hostile),
             VideoPart([FrameLabels(0.0, [Label(hostile, 0.9)])], hostile)]
    prompt = build_prompt(parts)
    # Exactly the markers the template itself writes: system, user, assistant opening.
    assert prompt.count("<|im_start|>") == 3 and prompt.count("<|im_end|>") == 2
    assert all(m not in user(parts) for m in CONTROL_MARKERS)
