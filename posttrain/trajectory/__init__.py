"""The trajectory contract and its on-disk ledger. Imports nothing above it."""

from posttrain.trajectory.collate import TrajectoryBatch, collate
from posttrain.trajectory.enums import Finish, Role, Status
from posttrain.trajectory.ledger import Ledger
from posttrain.trajectory.record import Reward, Trajectory, TrajectoryError, make_trajectory

__all__ = [
    "Finish",
    "Ledger",
    "Reward",
    "Role",
    "Status",
    "Trajectory",
    "TrajectoryBatch",
    "TrajectoryError",
    "collate",
    "make_trajectory",
]
