"""The projection layer, pure (no I/O): what the model sees, folded from a session's entries.

`messages` holds `Message` and derives one entry's message; `fold` folds a log into the projection
(cuts, surface replaces, the serialised snapshot state); `render` turns it into a provider's
request; `budget` cuts a legal suffix within a budget (`history`); `request` rebuilds what was sent
at an entry; `invariants` checks a log against the seeds' rules; `chunks` holds streamed answers'
records and rows; `nanobot` the nanobot session a log holds. See docs/design.md §6."""

from .budget import estimate_tokens, history
from .fold import ProjectionState, check_surface, needs_rebuild, project
from .messages import Message, cut_messages, derive_message
from .render import openai_messages, to_anthropic, to_openai

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
