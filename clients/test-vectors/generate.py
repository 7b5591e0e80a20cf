"""Write keys.json from the proxy's own key function (run after a change to the cases):

.venv/bin/python clients/test-vectors/generate.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.keys import Canonicalization, canonical_json, composite_key, fingerprint

JCS = Canonicalization.JCS
CASES: list[tuple[str, int | str, Any]] = [
    ("plan-7f3a", 3, {"account": "acme", "amount": 42}),
    ("plan-7f3a", 4, {"amount": 42, "account": "acme"}),
    ("p", 0, {}),
    ("p", "1.2", []),
    ("plan.a_b-c", 17, None),
    ("p", 1, True),
    ("p", 1, "a string"),
    ("p", 1, {"b": 1.0, "a": [1e21, "é"]}),
    (
        "p",
        1,
        {
            "numbers": [
                *(0, -0.0, 1, -1, 0.1, 0.000001, 1e-7, 123.456, 1e21, 1.5e300, -2.5e-300),
                *(9007199254740991, -9007199254740991, 4.35, 0.1e1, 5e-324),
                *(1.7976931348623157e308, 333333333.33333329, 0.30000000000000004, 1e-6),
            ]
        },
    ),
    ("p", 1, {"escapes": '"\\/\b\f\n\r\t\u0000\u001f\u007f\u2028\u2029'}),
    ("p", 1, {"unicode": "中文 😀 \U0001d11e \ue000 é"}),
    (
        "p",
        1,
        {"€": 1, "\r": 2, "😀": 3, "\ufb33": 4, "1": 5, "10": 6, "a": 7, "A": 8, "é": 9, "": 10},
    ),
    ("p", 1, {"nested": {"z": [1, {"y": None, "x": [True, False]}], "a": {"c": {}, "b": []}}}),
    ("p", 99, {"repo": "tool-proxy", "pr": 12}),
]
BODIES: list[tuple[str, str | None]] = [
    ("", None),
    ('{ "b" : 2, "a" : 1 }', None),
    ('{"b":2,"a":1}', "application/json"),
    ("not json", None),
    ("not json", "text/plain"),
    ('{"a":1}', "text/plain"),
    ('[1.0, 2e0, "\\u00e9"]', "application/vnd.x+json"),
]
DESCRIPTION = (
    "Keys as tool-proxy computes them (proxy/keys.py), written by generate.py. Checked by "
    "tests/test_keys.py (the proxy), tests/test_client_keys.py (tool-proxy-client) and "
    "clients/typescript/test/keys.test.ts. vectors: key = plan:step:sha256(RFC 8785 form of "
    "arguments); bodies: the args_hash of a raw body sent with that Content-Type (null: none)."
)


def main() -> None:
    vectors = [
        {
            "plan": plan,
            "step": step,
            "arguments": arguments,
            "canonical": canonical_json(arguments, JCS).decode(),
            "args_hash": composite_key(plan, step, arguments).rsplit(":", 1)[1],
            "key": composite_key(plan, step, arguments),
        }
        for plan, step, arguments in CASES
    ]
    bodies = [
        {
            "body": body,
            "content_type": kind,
            "args_hash": fingerprint(body.encode(), kind, JCS, None),
        }
        for body, kind in BODIES
    ]
    document = {"description": DESCRIPTION, "vectors": vectors, "bodies": bodies}
    text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    Path(__file__).with_name("keys.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
