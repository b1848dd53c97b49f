"""The projection layer, pure (no I/O): what the model sees, folded from a session's entries.

`fold` turns entries into `Message`s (cuts, surface replaces, the serialised snapshot state) and
renders them for providers; `request` rebuilds what was sent at an entry; `invariants` checks a
log against the seeds' rules. See docs/design.md §6."""

from .fold import (
    Message,
    ProjectionState,
    check_surface,
    cut_messages,
    derive_message,
    estimate_tokens,
    history,
    needs_rebuild,
    openai_messages,
    project,
    to_anthropic,
    to_openai,
)

__all__ = [
    "Message",
    "ProjectionState",
    "check_surface",
    "cut_messages",
    "derive_message",
    "estimate_tokens",
    "history",
    "needs_rebuild",
    "openai_messages",
    "project",
    "to_anthropic",
    "to_openai",
]
