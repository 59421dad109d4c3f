"""A drafter family from the test tree: MLPSpeculator's model under another name, registered as "toy" only through
the registry (drafters.registry.register), to show a family needs nothing else: its module and one registry entry."""

from __future__ import annotations

from typing import ClassVar

from drafters.mlp_speculator import MLPSpeculatorDrafter
from drafters.mlp_speculator_proposer import MLPSpeculatorProposer
from drafters.registry import Family


class ToyDrafter(MLPSpeculatorDrafter):
    kind: ClassVar[str] = "toy"


class ToyProposer(MLPSpeculatorProposer):
    drafter_class = ToyDrafter


FAMILY = Family(name="toy", description="a toy checkpoint (an MLPSpeculator under another name)",
                drafter="tests.drafters.toy:ToyDrafter", proposer_class="tests.drafters.toy:ToyProposer",
                config_matches=lambda config: (config.get("hsx") or {}).get("kind") == "toy",
                config_k=lambda config: config.get("n_predict"))  # MLPSpeculator's layout, its own hsx.kind
