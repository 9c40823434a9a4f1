"""Each knob is declared once (`DecodeParams`' fields, `engine/decoding/knobs.py`), and what reads
knobs reads that declaration: the checks, the JSON schema, the CLI flags, the slot tables' columns,
the policies (by name) and the modes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional

import pytest

from engine.decoding import knobs as K
from engine.decoding.knobs import ANY_POLICY, DecodeParamError, Float, Int, Words, knob
from engine.decoding.params import DecodeParams, field_types, json_schema
from engine.decoding.registry import ALL_MODES, POLICIES


def test_every_knob_has_a_check_and_names_only_registered_policies_and_modes():
    for f in fields(DecodeParams):
        assert callable(f.metadata["check"]), f.name
        for policy in f.metadata["reads"]:
            assert policy in POLICIES or f.metadata["reads"] == ANY_POLICY, (f.name, policy)
        assert f.metadata["modes"] is None or set(f.metadata["modes"]) <= ALL_MODES, f.name


def test_the_schema_and_the_cli_flags_list_every_knob_with_its_words():
    from server.cli.args import add_decode_flags

    schema = json_schema()["properties"]
    assert list(schema) == [f.name for f in fields(DecodeParams)]
    assert schema["policy"]["anyOf"][0]["enum"] == list(POLICIES)  # None: the model's family's default
    assert schema["top_p"]["anyOf"][0] == {"type": "number"}
    parser = argparse.ArgumentParser()
    add_decode_flags(parser)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == set(field_types())


def test_the_slot_tables_hold_exactly_the_knobs_some_policy_reads(llada_model):
    from engine import Engine

    declared = {f.name for f in fields(DecodeParams) if f.metadata["reads"]}
    engine = Engine.from_model(llada_model, max_batch=2)
    engine.add_request([1, 2, 3], DecodeParams(policy="threshold", gen_length=8, threshold=0.7, top_k=-1,
                                               eta_denominator="block"))
    engine.step()
    batch_rows = engine.slots.knobs
    assert sum(table.shape[1] for table in batch_rows.values()) == len(declared)
    from engine.batch import Batch

    rows = engine.slots.rows(Batch.build(list(engine.scheduler.running), engine.mode.plan, llada_model.device))
    assert set(rows.knobs) == declared
    k = rows.knobs
    assert float(k["threshold"][0]) == pytest.approx(0.7) and int(k["top_k"][0]) == -1
    assert int(k["policy"][0]) == list(POLICIES).index("threshold")
    assert int(k["eta_denominator"][0]) == 1 and float(k["top_p"][0]) == 1.0  # a word's index; None's stand-in


def test_a_new_declaration_is_a_checked_knob_and_a_column():
    """What a new policy's knob takes: one declaration gives its check and its slot-table column."""

    @dataclass(frozen=True)
    class Knobs:
        margin: float = knob(0.2, Float(0.0, 1.0), reads=("cai",))
        window: Optional[int] = knob(None, Int(low=1), reads=("cai",), none=0)
        mode_word: str = knob("a", Words(("a", "b")), reads=ANY_POLICY)
        host_only: int = knob(3, Int(low=0))

        def __post_init__(self) -> None:
            K.check_fields(self)

    with pytest.raises(DecodeParamError) as err:
        Knobs(margin=1.5)
    assert err.value.param == "margin"
    columns = {k.name: (k.kind, k.words) for k in K.device_knobs(Knobs)}
    assert columns == {"margin": (float, None), "window": (int, None), "mode_word": (int, ("a", "b"))}
    window, word = K.device_knobs(Knobs)[1:]
    assert K.device_value(window, None) == 0 and K.device_value(word, "b") == 1


@pytest.mark.parametrize("knob_name", [f.name for f in K.mode_knobs(DecodeParams)])
def test_a_mode_knob_has_a_default_that_every_mode_takes(knob_name):
    """A knob only some modes have is refused elsewhere only when set away from its default."""
    default = next(f.default for f in fields(DecodeParams) if f.name == knob_name)
    assert getattr(DecodeParams(), knob_name) == default
