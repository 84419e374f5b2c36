"""The write ledger's parts: its table of operators that write without saying so, what it
counts as existing before an attempt, its backups, and its refusal list as the README has it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autobatch._memory._accounting import HIDDEN_WRITES, op_facts, written_tensors
from autobatch._recovery._ledger import Ledger
from autobatch._recovery._rules import REFUSED, RULES, Kind, Refusal, Verdict, Write

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


# The table of hidden writers ------------------------------------------------------------------


def _batch_norm_calls() -> list[tuple[str, Any, tuple[Any, ...]]]:
    """Each hidden writer torch has on this machine, with arguments that make it write."""
    x = torch.randn(6, 3)
    calls: list[tuple[str, Any, tuple[Any, ...]]] = []
    calls.append(("aten::native_batch_norm", torch.ops.aten.native_batch_norm.default,
                  (x, None, None, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5)))
    calls.append(("aten::batch_norm_update_stats", torch.ops.aten.batch_norm_update_stats.default,
                  (x, torch.zeros(3), torch.ones(3), 0.1)))
    calls.append(("aten::_batch_norm_impl_index", torch.ops.aten._batch_norm_impl_index.default,
                  (x, None, None, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5, True)))
    return calls


@pytest.mark.parametrize(("name", "op", "args"), _batch_norm_calls(),
                         ids=[name for name, _, _ in _batch_norm_calls()])
def test_every_hidden_writer_writes_the_arguments_the_table_names(
    name: str, op: Any, args: tuple[Any, ...]
) -> None:
    written, flag = HIDDEN_WRITES[name]
    schema = op._schema
    positions = [i for i, a in enumerate(schema.arguments) if a.name in written]
    assert len(positions) == len(written)
    # the schema does not say so (else the entry would be redundant: drop it then)
    assert all(schema.arguments[i].alias_info is None for i in positions)
    before = [args[i].clone() for i in positions]
    versions = [args[i]._version for i in positions]
    op(*args)
    assert all(not torch.equal(b, args[i]) for b, i in zip(before, positions, strict=True))
    # ... and no version bump either: only the table tells
    assert [args[i]._version for i in positions] == versions
    facts = op_facts(op)
    assert [id(t) for t in written_tensors(facts, args, {})] == [id(args[i]) for i in positions]
    if flag is not None:  # a flag that turns the write off: then nothing is written
        off = list(args)
        off[[a.name for a in schema.arguments].index(flag)] = False
        assert written_tensors(facts, tuple(off), {}) == []


def test_every_entry_of_the_table_names_an_operator_torch_has() -> None:
    for name, (written, flag) in HIDDEN_WRITES.items():
        namespace, op = name.split("::")
        packet = getattr(getattr(torch.ops, namespace), op)
        for overload in packet.overloads():
            names = [a.name for a in getattr(packet, overload)._schema.arguments]
            if all(w in names for w in written):
                assert flag is None or flag in names
                break
        else:
            raise AssertionError(f"{name} has no overload with arguments {written}")


def test_a_batch_norm_forward_is_seen_writing_its_statistics() -> None:
    bn = nn.BatchNorm1d(3)
    seen: list[int] = []

    class Host:
        name, optimizers, schedulers, additive, fn = "step", (), (), (), None

        def modules_known(self) -> list[nn.Module]:
            return [bn]

        def named_modules_known(self) -> list[tuple[str, nn.Module]]:
            return [("bn", bn)]

        def params_known(self) -> list[torch.Tensor]:
            return []

    ledger = Ledger(Host())  # type: ignore[arg-type]
    ledger.open([], split=True)
    with ledger.attempt(early=True):
        bn(torch.randn(4, 3))
    seen = [id(t) for t in ledger.batch.tensors()]
    assert id(bn.running_mean) in seen
    assert id(bn.running_var) in seen
    assert id(bn.num_batches_tracked) in seen
    ledger.undo_batch()  # the statistics are back where they were
    assert torch.equal(bn.running_mean, torch.zeros(3))
    assert int(bn.num_batches_tracked) == 0
    ledger.close()


# What existed before, and what the rules say ---------------------------------------------------


def test_writes_to_tensors_made_in_the_attempt_are_the_steps_own() -> None:
    class Host:
        name, optimizers, schedulers, additive, fn = "step", (), (), (), None

        def modules_known(self) -> list[nn.Module]:
            return []

        def named_modules_known(self) -> list[tuple[str, nn.Module]]:
            return []

        def params_known(self) -> list[torch.Tensor]:
            return []

    held = torch.zeros(3)
    ledger = Ledger(Host())  # type: ignore[arg-type]
    ledger.open([], split=True)
    with ledger.attempt(early=True):
        made = torch.ones(3)
        made.mul_(2)  # its own: fine
        made.relu_()
        view = made[1:]
        view.add_(1)
        with pytest.raises(Refusal, match=r"changed tensor .* in place \(aten::add_\)"):
            held.add_(1)  # refused before it happens
        with pytest.raises(Refusal):
            held.data.add_(1)  # (another alias of the same storage: the same tensor)
    assert torch.equal(held, torch.zeros(3))
    ledger.close()


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_has_a_rule_and_early_writes_outside_a_forward_are_never_silent(
    kind: Kind,
) -> None:
    rule = RULES[kind]
    early = Write(kind, "t", "aten::add_", "", early=True, forward=False, backward=False,
                  stepped=False)
    verdict = rule.decide(early)
    allowed_early = {Kind.METRIC, Kind.ADDITIVE, Kind.BATCH, Kind.FRAMEWORK}
    if kind in allowed_early:
        assert verdict in (Verdict.BACKUP, Verdict.ALLOW)
    else:
        assert verdict is Verdict.REFUSE
        assert rule.why  # the refusal says why
        assert rule.fix  # and what to do


def test_buffers_written_in_their_forward_and_gradients_by_autograd_are_backed_up() -> None:
    forward = Write(Kind.BUFFER, "bn.running_mean", "", "", True, True, False, False)
    assert RULES[Kind.BUFFER].decide(forward) is Verdict.BACKUP
    autograd = Write(Kind.GRADIENT, "w.grad", "", "", True, False, True, False)
    assert RULES[Kind.GRADIENT].decide(autograd) is Verdict.BACKUP
    last = Write(Kind.PARAMETER, "w", "", "", False, False, False, False)
    assert RULES[Kind.PARAMETER].decide(last) is Verdict.BACKUP  # before the step: copied
    after = Write(Kind.PARAMETER, "w", "", "", False, False, False, True)
    assert RULES[Kind.PARAMETER].decide(after) is Verdict.ALLOW


# The README lists what the rules refuse ----------------------------------------------------


def test_the_readmes_refusal_list_is_the_rule_tables() -> None:
    section = README.split("**Refused**", 1)[1].split("**What a split step cannot see**", 1)[0]
    bullets = [line[2:].rstrip(";.") for line in section.splitlines() if line.startswith("- ")]
    assert bullets == list(REFUSED)
