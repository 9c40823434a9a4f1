"""schemathesis hooks for tests/operations/test_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

`accepted_unless_a_documented_rule_refuses`: every schema-valid request (the run generates only
those) is answered with 2xx, or refused with 400 and one of the codes of the rules a JSON schema
cannot state (server.serving_base.CROSS_FIELD_CODES: the context length, the rules between decoding
knobs, n x prompts, ...). schemathesis's own positive_data_acceptance is this check without the
exceptions."""

from __future__ import annotations

import schemathesis

from server.serving_base import CROSS_FIELD_CODES


@schemathesis.check
def accepted_unless_a_documented_rule_refuses(ctx, response, case) -> None:
    if response.status_code < 300:
        return
    code = None
    if response.status_code == 400:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
    if code in CROSS_FIELD_CODES:
        return
    raise AssertionError(f"a schema-valid request was refused: {response.status_code} {response.text[:500]}")
