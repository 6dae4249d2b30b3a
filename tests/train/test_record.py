"""train/record.py: the reported loss is the mean of the loss window, and the held-out τ is the
newest validated curve row's."""

from dflash_pipeline.measure.record import Interval
from dflash_pipeline.train.record import HeldOutTau, held_out_tau, window_loss


def test_the_reported_loss_is_the_window_mean_to_six_places():
    assert window_loss([2.0, 3.0, 2.1234567]) == 2.374486
    assert window_loss([]) is None


def test_the_held_out_tau_is_the_newest_validated_row():
    curve = [{"step": 1, "loss": 3.0},
             {"step": 2, "loss": 2.9, "tau": 1.25, "tau_ci95": 0.5, "slot_accuracy": [0.3, 0.1]},
             {"step": 3, "loss": 2.8, "tau": 1.5, "tau_ci95": 0.25, "slot_accuracy": [0.4, 0.2]},
             {"step": 4, "loss": 2.7}]
    assert held_out_tau(curve) == HeldOutTau(step=3, tau=Interval(1.5, 0.25), slot_accuracy=[0.4, 0.2])
    assert held_out_tau(curve[:1]) is None and held_out_tau([]) is None
