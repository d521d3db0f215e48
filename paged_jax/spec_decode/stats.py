"""Speculative decoding's counters (cumulative since start-up), for `stats()`, the batch summary and Prometheus."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    """`drafts`: sequences verified with at least one draft; `draft_tokens`: drafts scored; `accepted_tokens`: of
    those, kept; `accepted_per_position[j]`: drafts kept at position j (0-based) of their run."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)  # runs with at least j + 1 drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafts kept per verified sequence (the step yields this plus one token)."""
        return self.accepted_tokens / self.drafts if self.drafts else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        grow = num_drafts - len(self.proposed_per_position)
        if grow > 0:
            self.accepted_per_position.extend([0] * grow)
            self.proposed_per_position.extend([0] * grow)
        for j in range(num_drafts):
            self.proposed_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """Per draft position j: of the runs that had a j-th draft, the share that kept it."""
        pairs = zip(self.accepted_per_position, self.proposed_per_position, strict=True)
        return tuple(a / p if p else 0.0 for a, p in pairs)

    def as_dict(self) -> dict[str, float | int | tuple[float, ...]]:
        return {
            "spec_drafts": self.drafts,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
            "spec_mean_accepted_length": round(self.mean_accepted_length, 4),
            "spec_acceptance_per_position": tuple(round(a, 4) for a in self.acceptance_per_position),
        }
