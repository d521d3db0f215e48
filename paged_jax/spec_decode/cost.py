"""Does speculation pay for this batch? Measured decode tokens per second with it against without it.

A verify step scores 1 + k positions per speculating sequence and runs without the one-step lookahead (its drafts
need the previous step's tokens), so it costs more than a plain step; it pays only when the drafts it keeps make up
for that. Acceptance alone cannot say so: the price of a verify step depends on the model, the batch, the machine.
`CostGate` measures it. The engine reports each step it collects that only decoded (no prompt chunk in it): its
wall seconds (the engine `step` call that collected it: a plain step's lookahead overlap and a speculating step's
lost overlap are both in it), the tokens it yielded and its mode (speculating: it verified drafts, or it ran
without the lookahead so that its sequences could propose; else plain). A rate is an exponential moving average
of tokens over one of seconds (tokens per second of the recent steps' total time: a mean of per-step rates would
favour a mode whose step times vary, as a speculating step's do with its drafts), per batch-size bucket (powers
of two, as the runner's sequence buckets); the first step after a change of mode is not counted (it carries the
switch).

Policy, per bucket:
- speculation is on unless paused; after every `probe_steps` speculating steps it decides:
- the plain rate is unknown, or was measured more than `refresh_steps` steps ago: run `probe_steps` steps plainly
  (plus the switch) to measure it;
- speculating measured slower than plain by more than `margin` (a fraction of the plain rate): pause
  speculation for `pause_steps` steps, doubling (up to `MAX_PAUSE_FACTOR` x) each time it loses again, and at
  least long enough that the next probe's loss is `margin` of the time at most; a win resets the doubling.
  The margin keeps timing noise (other processes, a rate that is an average of a few steps) from pausing a
  batch where the two rates are in fact equal: speculating is then no loss, and it may be a gain the next
  probe sees.

Pausing only changes which steps carry drafts: outputs are the same either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_PAUSE_FACTOR = 16
EMA_WEIGHT = 0.3  # of the newest step


@dataclass(slots=True)
class Rate:
    """Tokens per second of the recent steps of one mode: EMAs of tokens and of seconds per step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.steps == 0 else EMA_WEIGHT
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.steps += 1

    @property
    def value(self) -> float | None:
        return self.tokens / self.seconds if self.steps else None


@dataclass(slots=True)
class BucketCosts:
    """One batch-size bucket's measurements and pause state (steps counted over every observed step)."""

    spec: Rate = field(default_factory=Rate)
    plain: Rate = field(default_factory=Rate)
    plain_at: int = -1  # step index of the latest plain measurement
    spec_steps: int = 0  # speculating steps since the last decision
    paused_until: int = 0  # speculation off for steps < this
    factor: int = 1  # the next pause's multiple of pause_steps
    last_mode: bool | None = None  # the mode of the latest observed step
    pauses: int = 0  # times paused because speculating lost

    @property
    def spec_rate(self) -> float | None:
        return self.spec.value

    @property
    def plain_rate(self) -> float | None:
        return self.plain.value


def bucket_of(num_seqs: int) -> int:
    """The power of two >= num_seqs (>= 1)."""
    return 1 << max(0, num_seqs - 1).bit_length()


class CostGate:
    def __init__(self, probe_steps: int, pause_steps: int, refresh_steps: int, margin: float = 0.0) -> None:
        self.probe_steps, self.pause_steps, self.refresh_steps = probe_steps, pause_steps, refresh_steps
        self.margin = margin
        self.buckets: dict[int, BucketCosts] = {}
        self.step = 0

    def _bucket(self, num_seqs: int) -> BucketCosts:
        key = bucket_of(num_seqs)
        costs = self.buckets.get(key)
        if costs is None:
            costs = self.buckets[key] = BucketCosts()
        return costs

    def allows(self, num_seqs: int) -> bool:
        """Whether a batch of `num_seqs` running sequences speculates now."""
        costs = self.buckets.get(bucket_of(num_seqs))
        return costs is None or self.step >= costs.paused_until

    def observe(self, num_seqs: int, speculating: bool, tokens: int, seconds: float) -> None:
        """A collected decode-only step of `num_seqs` sequences that yielded `tokens` in `seconds` of wall time."""
        self.step += 1
        costs = self._bucket(num_seqs)
        switched = costs.last_mode is not None and costs.last_mode != speculating
        costs.last_mode = speculating
        if switched or seconds <= 0 or tokens <= 0:
            return
        if not speculating:
            costs.plain.add(tokens, seconds)
            costs.plain_at = self.step
            return
        costs.spec.add(tokens, seconds)
        costs.spec_steps += 1
        if costs.spec_steps >= self.probe_steps:
            costs.spec_steps = 0
            self._decide(costs)

    def _decide(self, costs: BucketCosts) -> None:
        spec_rate, plain_rate = costs.spec_rate, costs.plain_rate
        assert spec_rate is not None, "decided right after a speculating step was recorded"
        if plain_rate is None or self.step - costs.plain_at > self.refresh_steps:
            costs.paused_until = self.step + self.probe_steps + 1  # measure plain decoding (+1: the switch)
        elif spec_rate < (1 - self.margin) * plain_rate:
            costs.paused_until = self.step + max(self.pause_steps * costs.factor, self._bounding_pause(costs))
            costs.factor = min(2 * costs.factor, MAX_PAUSE_FACTOR)
            costs.pauses += 1
        else:
            costs.factor = 1

    def _bounding_pause(self, costs: BucketCosts) -> int:
        """The plain steps after which the next probe's loss is at most `margin` of the time of probe and pause
        together (at most `MAX_PAUSE_FACTOR` pause lengths): a probe of `probe_steps` speculating steps loses
        their time x (1 - spec_rate / plain_rate), so a batch where speculating loses badly (a draft model whose
        own steps cost more than the steps it saves) is probed rarely, one where it barely loses often."""
        if self.margin <= 0:
            return 0
        spec_rate, plain_rate = costs.spec_rate, costs.plain_rate
        assert spec_rate is not None and plain_rate is not None, "both rates are measured before a pause"
        probe = self.probe_steps * costs.spec.seconds
        lost = probe * (1 - spec_rate / plain_rate)
        steps = (lost / self.margin - probe) / costs.plain.seconds
        return min(max(0, math.ceil(steps)), MAX_PAUSE_FACTOR * self.pause_steps)


__all__ = ["CostGate", "bucket_of"]
