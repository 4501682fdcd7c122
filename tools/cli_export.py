"""`specrt export`: the target and its drafter as ONNX graphs in an engine folder.

    specrt export --drafter dspark --drafter-ckpt PATH [--target PATH] [--out engines/NAME]
                  [--weights fp32|int4|int8|w8a8|gguf] [--dtype fp32|fp16] [--capacity N] [--draft-vocab N]

Without --target the embedded default (SmolLM2-135M-Instruct) is exported, with the drafter of
that kind shipped in the package when there is one; otherwise pass --drafter-ckpt (an
official-format drafter folder), or `--drafter none` to export only the target. The export itself
is `specrt.export.export.export_engine`; this module adds the flags, the copy files (datastore
and calibrated copy hit rates), which are computed by the runtime's copy proposer, and the token
counts a reduced DFlash/DSpark draft vocabulary is chosen from (the target's own responses in the
data sets specrt ships for it, or --draft-vocab-data).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specrt.export.export import _DTYPE_FLAGS, DEFAULT_BLOCK_DRAFT_VOCAB, DRAFTER_KINDS
from specrt.plugins.errors import SpecrtError
from specrt.tools.draft_flags import add_draft_arguments, resolve_draft_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, choices=DRAFTER_KINDS,
                        help="drafter kind to export with the target ('none': the target alone)")
    parser.add_argument("--target", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--drafter-ckpt", default=None,
                        help="drafter checkpoint folder (official format; default: the shipped one, if any)")
    parser.add_argument("--out", default=None, help="engine folder (default: engines/<target>-<drafter>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out when it is an existing engine folder (atomically; files added to it "
                             "are deleted with it)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPE_FLAGS), help="weights and K/V cache dtype")
    parser.add_argument("--opset", type=int, default=None, help="ONNX default-domain opset (18-23, default 20)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="K/V cache capacity recorded for the runtime (default: max_position_embeddings)")
    parser.add_argument("--external-data", default="auto", choices=("auto", "always", "never"),
                        help="auto/always: one weights file (weights.data) shared by every graph, each tensor stored once; "
                             "never: each graph keeps its own copy of its weights inside it (single-file graphs)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="DFlash/DSpark: the block head's logits over the target's N most frequent tokens only "
                             "(its end-of-sequence ids always kept; drafting costs much less, see "
                             "docs/choosing-a-drafter.md); 0: the full vocabulary. Default: "
                             f"{DEFAULT_BLOCK_DRAFT_VOCAB or 'the full vocabulary'}"
                             + (" where the target's token counts exist" if DEFAULT_BLOCK_DRAFT_VOCAB else ""))
    parser.add_argument("--draft-vocab-data", nargs="+", default=None, metavar="FOLDER",
                        help="data sets of the target's own responses (built by `specrt train data`) to count tokens "
                             "in for --draft-vocab (default: the ones specrt ships for the target, if any)")
    add_draft_arguments(parser.add_argument_group("drafting defaults recorded in the folder (the runtime starts "
                                                  "from them; flags of generate / serve override them)"),
                        max_drafts=True)
    q = parser.add_argument_group("weight quantization (ONNX Runtime MatMulNBits; see specrt.export.quantize)")
    q.add_argument("--weights", default="fp32", choices=("fp32", "fp16", "int8", "int4", "w8a8", "gguf"),
                   help="weights of the linear layers: fp32/fp16 (= --dtype), int8/int4 (RTN, weight-only), w8a8 "
                        "(int8 weights and per-token int8 activations in integer MatMuls: verify rows nearly free "
                        "on CPUs with AMX/VNNI; specrt.export.integer_matmul) or gguf (the GGUF target's own "
                        "Q4_0/Q4_1/Q8_0 blocks, bit for bit)")
    q.add_argument("--quant-block", type=int, default=32, help="int8/int4: weights per scale block along K")
    q.add_argument("--quant-asymmetric", action="store_true", help="int8/int4: zero points per block (default symmetric)")
    q.add_argument("--no-quant-lm-head", action="store_true", help="int8/int4: keep the LM head in float")
    q.add_argument("--drafter-weights", default="same", choices=("same", "fp32", "int8", "int4", "w8a8"),
                   help="the drafter's graphs: same as --weights, or their own (e.g. an fp32 target with an int4 "
                        "drafter: drafting gets cheaper, verification stays fp32, so output is unchanged)")
    q.add_argument("--quant-accuracy-level", type=int, default=4, choices=(0, 1, 2, 3, 4),
                   help="MatMulNBits compute: 4 = int8 activations (fastest on CPU), 0 = float activations")
    parser.add_argument("--no-ort-fused", action="store_true",
                        help="skip target_ort, the ONNX Runtime contrib-op target graph (specrt.export.ort_fused) "
                             "that runs single streams faster on ORT's CPU provider (target calls ~1.25x fp32, ~1.35x int4); the portable graph "
                             "(any ONNX runtime, TensorRT) is always written")
    parser.add_argument("--no-lookup-files", action="store_true",
                        help="skip lookup.json and datastore.npz (copy hit rates and the 16 MB store of the target's "
                             "own answers, written for a target whose data specrt ships): copies then start from a "
                             "flat prior and come from the request's own text only")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def quant_options(args: argparse.Namespace):
    """QuantOptions for --weights int8/int4 (None for float weights); --weights fp16 means --dtype fp16."""
    if args.weights in ("fp32", "fp16"):
        if args.weights == "fp16" and args.dtype not in ("fp16", "float16"):
            args.dtype = "fp16"
        return None
    return _rtn_options(args, args.weights, "--weights")


def _rtn_options(args: argparse.Namespace, weights: str, flag: str):
    """QuantOptions for `weights` (int8/int4/gguf) with the shared --quant-* flags; fp32 graphs only."""
    if args.dtype not in ("fp32", "float32"):
        raise SpecrtError(f"{flag} {weights} quantizes fp32 graphs, not --dtype {args.dtype}",
                          "drop --dtype (quantized weights run with fp32 activations and norms)")
    from specrt.export.quantize import QuantOptions

    return QuantOptions(weights, args.quant_block, not args.quant_asymmetric, args.quant_accuracy_level,
                        lm_head=not args.no_quant_lm_head)


def drafter_quant_options(args: argparse.Namespace, quant):
    """The drafter graphs' QuantOptions: "same" as the target's, None for float, or their own int8/int4."""
    if args.drafter_weights == "same":
        return quant
    if args.drafter_weights == "fp32":
        if args.dtype not in ("fp32", "float32"):
            raise SpecrtError(f"--drafter-weights fp32 with --dtype {args.dtype}",
                              "drop --drafter-weights (the drafter follows --dtype) or export with --dtype fp32")
        return None
    return _rtn_options(args, args.drafter_weights, "--drafter-weights")


def copy_files_for(folder: Path, target_name: str) -> str | None:
    """lookup.json + datastore.npz from the data sets specrt ships for this target (none: nothing written)."""
    from specrt.tools.copy_files import shipped_data_for, write_lookup_files

    data = shipped_data_for(target_name)
    if not data:
        return None
    write_lookup_files(data, folder, progress=lambda message: None)  # the stage line reports it
    return f"copy hit rates and datastore from {len(data)} shipped data sets"


def token_counts_from(folders: list[str] | None):
    """token_counts for export_engine: (occurrences of each target token in the responses of `folders`, or
    of the data sets specrt ships for the target, and their names), or None when there are none."""

    def counts(target_name: str, vocab_size: int):
        import numpy as np

        from specrt.tools.copy_files import read_data_sets, shipped_data_for

        data = [Path(f) for f in folders] if folders else shipped_data_for(target_name)
        if not data:
            return None
        samples, label = read_data_sets(data)
        ids = np.fromiter((int(t) for s in samples for t in s["response"]), dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise SpecrtError(f"{label} hold token ids outside the target's vocabulary of {vocab_size}",
                              "pass --draft-vocab-data with data sets this target generated")
        return np.bincount(ids, minlength=vocab_size), f"the responses of {label}"

    return counts


def run(args: argparse.Namespace) -> int:
    from specrt.export.export import export_engine

    quant = quant_options(args)
    drafter_quant = drafter_quant_options(args, quant)
    if args.drafter == "none" and args.drafter_weights != "same":
        raise SpecrtError(f"--drafter-weights {args.drafter_weights} without a drafter",
                          "pass --drafter KIND, or drop --drafter-weights")
    draft_options = resolve_draft_options(args)  # bad values fail before the long export
    export_engine(
        args.drafter, target=args.target, drafter_ckpt=args.drafter_ckpt, out=args.out, dtype=args.dtype,
        opset=args.opset, capacity=args.capacity, external_data=args.external_data, quiet=args.quiet,
        command=list(sys.argv), quant=quant, drafter_quant=drafter_quant, ort_fused=not args.no_ort_fused,
        draft_options=draft_options, extra_files=None if args.no_lookup_files else copy_files_for,
        overwrite=args.overwrite, draft_vocab=args.draft_vocab, token_counts=token_counts_from(args.draft_vocab_data),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`specrt export ...` as a function (tests and scripts)."""
    from specrt.plugins.errors import run_reporting_errors

    parser = argparse.ArgumentParser(prog="specrt export", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_reporting_errors("specrt export", lambda: run(args))
