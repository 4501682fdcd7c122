"""The specrt custom ops as a set: exporter hooks, model-local functions, and graph audits.

How an op gets into an exported graph (`specrt.export.onnx_export`):

1. The export wrappers call the torch custom ops (`torch.ops.specrt.tree_attention`, ...), whose eager
   bodies are the torch references.
2. `torch.onnx.export(dynamo=True, custom_translation_table=translation_table())` turns each call into
   one node `specrt::<Op>`; `registered_schemas()` makes the op schemas known to onnx only for that
   call. The node carries no body yet, so the exporter's opset conversion (which inlines every local
   function it sees) leaves it alone.
3. `attach_functions(model)` adds each used op's body as a model-local function written for the
   model's own default-domain opset (ONNX requires the function's opset imports to match the model's).

ONNX Runtime (any EP) and other runtimes then execute the function body; TensorRT's ONNX parser
imports the node as a plugin of the same name and domain when one is registered, else it inlines the
body. `audit_domains` checks that a graph uses nothing but standard ops and the specrt functions.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from specrt.plugins import confidence_truncate, tree_attention

DOMAIN = "specrt"
DOMAIN_VERSION = 1
MIN_OPSET = 18  # the function bodies use opset-18 forms (axes as inputs, Split/Reduce* signatures)
MAX_OPSET = 23  # the newest default-domain opset onnxscript writes
STANDARD_DOMAINS = ("", "ai.onnx")
OP_MODULES = {tree_attention.OP_NAME: tree_attention, confidence_truncate.OP_NAME: confidence_truncate}


def translation_table() -> dict:
    """torch custom op overload -> exporter translation (one specrt node each)."""
    import torch

    return {
        torch.ops.specrt.tree_attention.default: tree_attention.translation,
        torch.ops.specrt.confidence_truncate.default: confidence_truncate.translation,
    }


@contextlib.contextmanager
def registered_schemas() -> Iterator[None]:
    """Make the specrt op schemas known to onnx while exporting; unregister them afterwards.

    Outside the export the schemas stay unregistered, so the checker, shape inference and ONNX
    Runtime see the nodes as what they are in the file: calls of model-local functions.
    """
    import onnx.defs

    added = []
    try:
        for name, module in OP_MODULES.items():
            if not onnx.defs.has(name, DOMAIN):
                onnx.defs.register_schema(module.onnx_schema())
                added.append(name)
        yield
    finally:
        for name in added:
            onnx.defs.deregister_schema(name, DOMAIN_VERSION, DOMAIN)


def check_opset(opset_version: int) -> int:
    from specrt.plugins.errors import SpecrtError

    if not MIN_OPSET <= int(opset_version) <= MAX_OPSET:
        raise SpecrtError(
            f"ONNX opset {opset_version} is not supported for export",
            f"use an opset between {MIN_OPSET} and {MAX_OPSET} (default 20)",
        )
    return int(opset_version)


def function_proto(op_name: str, opset_version: int):
    """The onnx.FunctionProto of one op for a model whose default-domain opset is opset_version."""
    return OP_MODULES[op_name].onnx_function(check_opset(opset_version)).to_function_proto()


def used_ops(model) -> list[str]:
    """specrt op types used by the nodes of an onnx.ModelProto graph (subgraphs included)."""
    found: set[str] = set()

    def visit(graph) -> None:
        for node in graph.node:
            if node.domain == DOMAIN:
                found.add(node.op_type)
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    visit(attr.g)
                for g in attr.graphs:
                    visit(g)

    visit(model.graph)
    return sorted(found)


def attach_functions(model) -> list[str]:
    """Add the bodies of the specrt ops `model` (onnx.ModelProto) uses; returns their names."""
    import onnx

    opset = next((o.version for o in model.opset_import if o.domain in STANDARD_DOMAINS), None)
    if opset is None:
        raise ValueError("the model imports no default-domain opset")
    names = used_ops(model)
    present = {(f.domain, f.name) for f in model.functions}
    for name in names:
        if (DOMAIN, name) not in present:
            model.functions.append(function_proto(name, opset))
    if names and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return names


def audit_domains(model) -> list[str]:
    """Problems with the ops of an onnx.ModelProto: anything outside the standard domains other than
    a specrt node with a local function, and function bodies that are not standard ops. [] = clean."""
    problems: list[str] = []
    functions = {(f.domain, f.name): f for f in model.functions}

    def visit(nodes, where: str) -> None:
        for node in nodes:
            if node.domain in STANDARD_DOMAINS:
                pass
            elif node.domain == DOMAIN and (DOMAIN, node.op_type) in functions and where == "graph":
                pass
            else:
                problems.append(f"{where}: node {node.name or node.op_type} is {node.domain}::{node.op_type}")
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    visit(attr.g.node, where)
                for g in attr.graphs:
                    visit(g.node, where)

    visit(model.graph.node, "graph")
    for (domain, name), function in functions.items():
        if domain != DOMAIN or name not in OP_MODULES:
            problems.append(f"unexpected local function {domain}::{name}")
        visit(function.node, f"function {domain}::{name}")
    return problems


def single_op_model(op_name: str, inputs: list, outputs: list, attributes: dict | None = None,
                    opset_version: int = 20):
    """A one-node model calling specrt::op_name (tests, tools/compare). inputs/outputs: onnx ValueInfoProtos."""
    import onnx
    from onnx import helper

    node = helper.make_node(op_name, [v.name for v in inputs], [v.name for v in outputs], domain=DOMAIN,
                            **(attributes or {}))
    graph = helper.make_graph([node], f"specrt_{op_name}", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset_version), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=[function_proto(op_name, opset_version)],
    )
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(model, full_check=True)
    return model


__all__ = [
    "DOMAIN", "DOMAIN_VERSION", "MIN_OPSET", "MAX_OPSET", "OP_MODULES", "translation_table", "registered_schemas",
    "check_opset", "function_proto", "used_ops", "attach_functions", "audit_domains", "single_op_model",
]
