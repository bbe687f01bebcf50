"""The pinned host allocator's settings moectl prefers (trainer/runtime.py: prefer_fast_pinning)."""

from __future__ import annotations

from trainer.runtime import ALLOC_ENV, FAST_PINNING, prefer_fast_pinning


def test_added_when_unset_and_appended_to_other_keys() -> None:
    env: dict[str, str] = {}
    assert prefer_fast_pinning(env) and env[ALLOC_ENV] == FAST_PINNING
    env = {ALLOC_ENV: "expandable_segments:True"}
    assert prefer_fast_pinning(env) and env[ALLOC_ENV] == f"expandable_segments:True,{FAST_PINNING}"


def test_the_users_pinned_keys_win_and_a_second_call_adds_nothing() -> None:
    env = {ALLOC_ENV: "pinned_use_cuda_host_register:False"}
    assert not prefer_fast_pinning(env) and env[ALLOC_ENV] == "pinned_use_cuda_host_register:False"
    env = {}
    prefer_fast_pinning(env)
    assert not prefer_fast_pinning(env) and env[ALLOC_ENV] == FAST_PINNING
