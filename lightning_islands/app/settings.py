"""The app's settings: the launcher's own (``link``, ``members``, ``max_restarts``, ``secret_file``)
beside the engine's :class:`~lightning_islands.engine.IslandSettings`, and the Hydra ``islands`` group
that is both (:class:`IslandsConfig`, registered as ``islands/schema``: every option of the group
starts from it, so a key that is not a setting, or a value of the wrong type, is refused when the
job is composed, before anything starts).

Every default and help text lives on the fields (``setting(default, help)``); docs/SETTINGS.md is
generated from them (:func:`settings_reference`) and a test keeps it so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lightning_islands.app.gpus import SHARING
from lightning_islands.app.step_delay import parse_step_delays
from lightning_islands.engine.settings import IslandSettings, check_types, setting

# settings that were removed, with what replaced them (a job written before names them)
REMOVED_SETTINGS = {
    "timeout_s": "an island without progress is given up after islands.grace_s, and every wait ends at "
                 "islands.deadline_s",
    "max_wait_s": "it became islands.deadline_s, the longest one round may take",
}


@dataclass
class Member:
    """One island of the app's job: its processes, their batch and how it differs from the others."""

    devices: int = setting(1, "Processes of this island (one per GPU; on CPU, one per process).")
    batch_size: int | None = setting(None, "Sequences per data-parallel process and step (null: `data.batch_size`).")
    tensor_parallel_size: int = setting(
        1, "Processes that split each layer and read the same batch (it divides `devices`).")
    expert_parallel_size: int = setting(
        1, "1, or all data-parallel processes of the island: each then owns whole experts.")
    steps_per_round: int | None = setting(
        None, "Fixed inner steps per round for this island (null: the islands' `steps_per_round`).")
    precision: str | None = setting(None, "This island's Trainer precision, e.g. `bf16-mixed` (null: the Trainer's).")
    accelerator: str | None = setting(
        None, "`gpu` or `cpu` for this island (null: `trainer.accelerator`); GPU islands get GPUs of their own "
              "(`gpus`).")
    step_delay_s: Any = setting(
        0.0, "Sleep this long after every step: emulates a slower island. A number, or a schedule "
             "`'1.5,0.5@200,1.5@400'`: 1.5 s after each step, 0.5 s from step 200, 1.5 s again from step 400.")

    def __post_init__(self) -> None:
        check_types(self, "islands.members[i]")
        for name in ("devices", "tensor_parallel_size", "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"islands.members[i].{name} must be >= 1, got {getattr(self, name)}")
        if self.devices % self.tensor_parallel_size:
            raise ValueError(f"islands.members[i].tensor_parallel_size={self.tensor_parallel_size} must divide "
                             f"devices={self.devices}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"islands.members[i].batch_size must be >= 1 or null, got {self.batch_size}")
        if self.steps_per_round is not None and self.steps_per_round < 1:
            raise ValueError(f"islands.members[i].steps_per_round must be >= 1 or null, got {self.steps_per_round}")
        parse_step_delays(self.step_delay_s, "islands.members[i].step_delay_s")
        if self.accelerator is not None and self.accelerator not in ("gpu", "cpu"):
            raise ValueError(f"islands.members[i].accelerator must be gpu, cpu or null, got {self.accelerator!r}")


def _member(value: Any, index: int) -> Member:
    """``islands.members[index]`` as a :class:`Member`; an error names the island."""
    if isinstance(value, Member):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"islands.members[{index}] must be a mapping such as {{devices: 1, batch_size: 16}}, "
                         f"got {value!r}")
    unknown = sorted(set(value) - {f.name for f in fields(Member)})
    if unknown:
        raise ValueError(f"islands.members[{index}].{unknown[0]} is not a member key; they are "
                         f"{', '.join(f.name for f in fields(Member))} (docs/SETTINGS.md)")
    try:
        return Member(**value)
    except ValueError as err:
        raise ValueError(str(err).replace("members[i]", f"members[{index}]")) from None


def _two_islands() -> list[Member]:
    return [Member(devices=2, batch_size=8), Member(devices=1, batch_size=16)]


@dataclass
class LaunchSettings:
    """How the app launches the islands on this machine (the engine knows no launcher): which islands,
    behind what link, restarted how often, with which secret."""

    members: list[Member] = setting(None, "One entry per island (see the member keys below).", factory=_two_islands)
    link: Any = setting(
        None, "A shaped link between the islands on this machine: `RATE[,RTT][,tuned][,I=RATE]` in bits per second, "
              "e.g. `'1gbit,100ms'` (quote it) or `[1gbit,100ms]`, `'1gbit,100ms,3=200mbit'`: island 3 behind 200 "
              "Mbit/s; each island in its own network namespace behind a "
              "tc-shaped veth (needs root and iproute2). null: loopback.")
    max_restarts: int = setting(0, "Restart an island that died up to this many times; it rejoins the others.")
    gpus: str = setting(
        "own", "`own`: each GPU island sees GPUs of its own on this machine (a set that needs more than it has is "
               "refused); `shared`: every GPU island sees every GPU (islands emulated on one device).")
    coordinator: str | None = setting(
        None, "Where the islands meet: `etcd://h1:2379,h2:2379,h3:2379` (an etcd cluster, which survives losing a "
              "member: `lightning-islands coordinator --etcd 3` starts one here) or `HOST:PORT` (a coordinator "
              "started elsewhere). null: a TCPStore the launcher starts for the run.")
    secret_file: str | None = setting(
        None, "A file (mode 600) holding the islands' shared secret: every payload and round header then carries "
              "an HMAC (SECURITY.md). null: `LI_SECRET_FILE`, else `LI_SECRET`, else none. Never the secret itself.")

    def check_launch(self) -> None:
        """A ValueError naming the first launcher setting that is wrong."""
        if not self.members:
            raise ValueError("islands.members is empty: give one entry per island, e.g. "
                             "islands.members='[{devices:1},{devices:1}]'")
        if self.gpus not in SHARING:
            raise ValueError(f"islands.gpus must be own or shared, got {self.gpus!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0 (islands.max_restarts), got {self.max_restarts!r}")
        if self.coordinator is not None:
            from lightning_islands.link.coordinator import check_address

            check_address(str(self.coordinator))
            if self.link is not None:
                raise ValueError("islands.coordinator and islands.link together: the shaped link's namespaces reach "
                                 "only the coordinator the launcher starts at the hub; drop one of them")


@dataclass
class IslandsConfig(IslandSettings, LaunchSettings):
    """The Hydra ``islands`` group: the engine's settings and the launcher's, one flat namespace."""

    def __post_init__(self) -> None:
        self.members = [_member(m, i) for i, m in enumerate(self.members or [])]
        self.check_launch()
        IslandSettings.__post_init__(self)


def _plain(node: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node)


def engine_settings(islands: Mapping[str, Any], steps_per_round: int | None = None) -> IslandSettings:
    """The engine's settings from the ``islands`` group of a job (a composed or saved config): its
    engine keys, the launcher's ignored; ``steps_per_round`` (a member's) replaces the islands' own."""
    values = _plain(islands)
    for old, why in REMOVED_SETTINGS.items():
        if old in values:
            raise ValueError(f"islands.{old} is no longer a setting: {why}; remove it from your islands config "
                             "(or the command line)")
    return IslandSettings.from_mapping(values, steps_per_round)


def check_islands(islands: Mapping[str, Any]) -> IslandsConfig:
    """The whole ``islands`` group checked (engine and launcher), as the driver does before anything
    starts; a ValueError names the key, the value and the fix."""
    values = _plain(islands)
    engine_settings(values)  # a removed setting is named with what replaced it
    unknown = sorted(set(values) - {f.name for f in fields(IslandsConfig)})
    if unknown:
        raise ValueError(f"islands.{unknown[0]} is not a setting; remove it (docs/SETTINGS.md lists them)")
    checked = IslandsConfig(**values)
    for i, member in enumerate(checked.members):  # each island's settings, as its worker will build them
        if member.steps_per_round is not None:
            try:
                engine_settings(values, member.steps_per_round)
            except ValueError as err:
                raise ValueError(f"islands.members[{i}].steps_per_round={member.steps_per_round}: {err}") from None
    return checked


def settings_reference() -> str:
    """docs/SETTINGS.md: every setting of the ``islands`` group and of a member, its default and help."""

    def table(cls: type, prefix: str) -> list[str]:
        rows = ["| key | default | what it does |", "|---|---|---|"]
        for f in fields(cls):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            shown = OmegaConf.to_yaml({"v": default}).strip()[3:] if default is not None else "null"
            if f.name == "members":
                shown = "two islands: 2x8 + 1x16"
            rows.append(f"| `{prefix}{f.name}` | `{shown}` | {f.metadata['help']} |")
        return rows

    lines = [
        "# Settings",
        "",
        "Generated from `lightning_islands/engine/settings.py` (`IslandSettings`, the engine's) and",
        "`lightning_islands/app/settings.py` (`LaunchSettings` and `Member`, the launcher's); a test keeps this",
        "page equal to them. In the Hydra app every key is `islands.KEY=VALUE`; from Python,",
        "`IslandStrategy(IslandSettings(KEY=VALUE))` or `IslandStrategy(KEY=VALUE)`. A key that is not listed",
        "here, or a value of the wrong type, is refused before anything starts.",
        "",
        "The default job (`conf/islands/two_hetero.yaml`) pins `sync_every: 25` and `outer_momentum: 0.5` for",
        "its 300 steps, saying why there.",
        "",
        "## The engine (`IslandSettings`)",
        "",
        *table(IslandSettings, ""),
        "",
        "## The launcher (`LaunchSettings`, app only)",
        "",
        *table(LaunchSettings, ""),
        "",
        "## An island (`Member`, each entry of `islands.members`)",
        "",
        *table(Member, ""),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """``python -m lightning_islands.app.settings > docs/SETTINGS.md``: print the settings reference."""
    print(settings_reference(), end="")


def register() -> None:
    """Put :class:`IslandsConfig` in Hydra's config store as ``islands/schema`` (idempotent)."""
    ConfigStore.instance().store(group="islands", name="schema", node=IslandsConfig)


register()

if __name__ == "__main__":
    main()
