"""The real OPA as an oracle for byoc-policy's findings (tests/oracle.rs).

Reads one JSON request on stdin:
  {"cases": [{"name": str, "policy": str, "package": "nuon"|"main",
              "rules": [str], "inputs": [any]}]}
and prints, for each case, either {"load_error": str} or
  {"results": [[{"rule": str, "value": any} | {"rule": str, "undefined": true}
                | {"rule": str, "error": str}] per input]}.

OPA comes from PyPI's opa-golib-python-bindings (OPA built as a Go shared library),
which scripts/setup unpacks into the project's .venv.
"""

import json
import sys

from opa_bindings import OpaEngine, OpaError, OpaUndefinedError


def run_case(case):
    engine = OpaEngine()
    try:
        try:
            engine.add_policy(case["name"], case["policy"])
        except OpaError as e:
            return {"load_error": str(e)}
        results = []
        for doc in case["inputs"]:
            per_input = []
            for rule in case["rules"]:
                try:
                    value = engine.eval_document(f"{case['package']}.{rule}", doc)
                    per_input.append({"rule": rule, "value": value})
                except OpaUndefinedError:
                    per_input.append({"rule": rule, "undefined": True})
                except OpaError as e:
                    per_input.append({"rule": rule, "error": str(e)})
            results.append(per_input)
        return {"results": results}
    finally:
        engine.close()


def main():
    request = json.load(sys.stdin)
    json.dump({"cases": [run_case(c) for c in request["cases"]]}, sys.stdout)


if __name__ == "__main__":
    main()
