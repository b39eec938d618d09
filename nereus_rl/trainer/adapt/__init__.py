"""The adaptation loop, trainer side: :class:`Adapter` observes each step at a safe
boundary, asks the policy (:mod:`nereus_rl.policy`) for a Decision and carries out a
taken move (:mod:`.move`), logging each Decision with its Outcome; :class:`Planning`
(:mod:`.pricing`) is the run's view of plans it decides with."""

from nereus_rl.trainer.adapt.adapter import Adapter, StepSignals
from nereus_rl.trainer.adapt.move import MoveHost, compile_priced, execute_move, price_move
from nereus_rl.trainer.adapt.pricing import Planning

__all__ = [
    "Adapter",
    "MoveHost",
    "Planning",
    "StepSignals",
    "compile_priced",
    "execute_move",
    "price_move",
]
