"""An emulated slow island's delay after each step: a constant or a schedule (app/step_delay.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_islands.app.settings import Member
from lightning_islands.app.step_delay import StepDelays, parse_step_delays
from lightning_islands.app.worker import StepDelay


@pytest.mark.parametrize("value, starts, seconds", [
    (0.5, (0,), (0.5,)), (0, (0,), (0.0,)), ("0.25", (0,), (0.25,)),
    ("1.5,0.5@200,1.5@400", (0, 200, 400), (1.5, 0.5, 1.5)), (" 0 , 2@3 ", (0, 3), (0.0, 2.0)),
])
def test_a_delay_is_a_number_or_a_schedule_of_changes(value, starts, seconds):
    assert parse_step_delays(value) == StepDelays(starts, seconds)


def test_the_schedule_holds_each_delay_from_its_step_until_the_next():
    delays = parse_step_delays("1.5,0.5@200,1.5@400")
    assert [delays.at(s) for s in (0, 199, 200, 399, 400, 10**6)] == [1.5, 1.5, 0.5, 0.5, 1.5, 1.5]
    assert delays.active and not parse_step_delays("0,0@5").active


@pytest.mark.parametrize("value, says", [
    (-1, "not a finite delay >= 0"), ("0.5,nan@3", "not a finite delay"), ("inf", "not a finite delay"),
    ("1@5", "only the first delay has no '@STEP'"), ("1,2", "only the first delay has no '@STEP'"),
    ("1,2@5,3@5", "step 5 of '3@5' does not come after step 5"), ("1,2@x", "cannot read '2@x'"),
    ("", "must be a number of seconds, or a schedule"), (True, "must be"), ([1, 2], "must be"),
])
def test_a_bad_delay_names_the_setting_and_the_form(value, says):
    with pytest.raises(ValueError, match=says) as err:
        parse_step_delays(value, "islands.members[1].step_delay_s")
    assert "islands.members[1].step_delay_s" in str(err.value) and "'1.5,0.5@200,1.5@400'" in str(err.value)
    with pytest.raises(ValueError, match="islands.members\\[i\\].step_delay_s"):
        Member(step_delay_s=value)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_trainer_sleeps_after_each_step_as_the_schedule_says(tmp_path):
    slept: list[float] = []
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 2)), batch_size=2)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[StepDelay(parse_step_delays("0.01,0.2@2,0@4"), slept.append)])
    trainer.fit(_Tiny(), data)
    assert slept == [0.01, 0.01, 0.2, 0.2, 0.0, 0.0]
