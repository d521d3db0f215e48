"""The one error a request is refused with: `FieldError(field, message)`.

`field` is in the engine's vocabulary (`paged_jax.engine.input_processor` lists it: `prompt`,
`prompt_token_ids`, `messages[1].content`, `cache_salt`, and every `SamplingParams` field by its own name);
each front shows it in its own words through a table (`FieldNames`), never by parsing the message. A
`FieldError` is a `ValueError` whose text is `"<field>: <message>"`, so code that catches ValueError keeps
working and prints the same text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


class FieldError(ValueError):
    """A request refused because of one field: `field` (engine vocabulary) and what is wrong with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def renamed(self, names: FieldNames) -> FieldError:
        """The same error with its field in a front's vocabulary (`names`)."""
        return FieldError(names.front_name(self.field), self.message)


@dataclass(frozen=True, slots=True)
class FieldNames:
    """How one front names the engine's fields: `table` maps a field's head (the name before any `[i]` or
    `.sub`) to the front's name; heads not in the table keep their name, with `prefix` before them."""

    table: Mapping[str, str] = field(default_factory=dict)
    prefix: str = ""

    def front_name(self, engine_field: str) -> str:
        cut = min((i for i in (engine_field.find("["), engine_field.find(".")) if i >= 0), default=len(engine_field))
        head, rest = engine_field[:cut], engine_field[cut:]
        return (self.table[head] if head in self.table else self.prefix + head) + rest


class UsageError(ValueError):
    """A command-line value that is wrong (a flag out of range, a bad JSON field, a port in use); the message
    starts with the flag. The `paged-jax` commands print it as one line and exit with status 2."""
