"""Structured outputs on the engine: a random model's outputs held to a JSON schema, a regex, a
choice or a Lark grammar; the masked distribution's logprobs; speculation on for the rest of the batch."""
from __future__ import annotations

import json
import re

import pytest

from rollwise import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llms(model_dir):
    return LLM(model_dir, seed=0), LLM(model_dir, seed=0, speculative="suffix", spec_controller="always")


def _p(spec, seed=0, **kw):
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 120, "seed": seed, "structured_outputs": spec, **kw})


def _accepts(model_dir, lark: str):
    """Whether llguidance's matcher takes a text whole under the Lark grammar (the test model's tokens)."""
    from pathlib import Path

    import llguidance
    tok = llguidance.LLTokenizer((Path(model_dir) / "tokenizer.json").read_text())
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar)
        ids = tok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    return accepts


def test_a_random_models_samples_follow_the_schema_with_or_without_speculation(llms):
    plain, spec = llms
    prompts = [f"person {i}:" for i in range(6)]
    outs = [plain.generate(prompts, [_p({"json": SCHEMA}, seed=i) for i in range(6)]),
            spec.generate(prompts, [_p({"json": SCHEMA}, seed=i) for i in range(6)])]
    for o in outs[0]:
        assert o.finish_reason == "stop", o.text
        v = json.loads(o.text)
        assert set(v) == {"name", "age", "tags"} and isinstance(v["name"], str) and len(v["name"]) <= 6
        assert isinstance(v["age"], int) and 0 <= v["age"] <= 120 and set(v["tags"]) <= {"a", "b"} and len(v["tags"]) <= 3
    assert len({o.text for o in outs[0]}) > 1  # sampled, not one fixed answer
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]  # a grammar request is never drafted


def test_regex_choice_grammar_and_any_json_object(llms):
    plain, _ = llms
    regex = r"[A-Z][a-z]{2,5}-\d{3}"
    for o in plain.generate(["code:"] * 4, [_p({"regex": regex}, seed=i) for i in range(4)]):
        assert re.fullmatch(regex, o.text), o.text
    choices = ["red", "green", "blue"]
    got = {o.text for o in plain.generate(["colour:"] * 12, [_p({"choice": choices}, seed=i) for i in range(12)])}
    assert got <= set(choices) and len(got) > 1
    lark = 'start: "x=" NUM ("+" NUM)*\nNUM: /[1-9]/'
    for o in plain.generate(["sum:"] * 3, [_p({"grammar": lark}, seed=i, max_tokens=20) for i in range(3)]):
        assert re.fullmatch(r"x=[1-9](\+[1-9])*", o.text), o.text
    for o in plain.generate(["obj:"] * 3, [_p({"json_object": True}, seed=i, max_tokens=200) for i in range(3)]):
        assert o.finish_reason != "stop" or isinstance(json.loads(o.text), dict)


def test_logprobs_are_the_masked_distributions(llms):
    plain, _ = llms
    forced = plain.generate(["say:"], _p({"choice": ["yes"]}, logprobs=3))[0]
    *word, end = forced.token_ids
    assert forced.text == "yes" and end in plain.engine.eos_token_ids
    # one token allowed at each position of the word (logprob 0, the rest -inf); then any of the EOS ids
    assert forced.logprobs[:len(word)] == [0.0] * len(word)
    assert all(sorted(top.values())[-2] == float("-inf") for top in forced.top_logprobs[:len(word)])
    assert {t for t, lp in forced.top_logprobs[-1].items() if lp > float("-inf")} <= plain.engine.eos_token_ids


def test_speculation_stays_lossless_beside_a_structured_request(llms, model_dir):
    _, spec = llms
    alone = spec.generate(["the cat sat on the mat. the cat sat on the"],
                          SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    both = spec.generate(["the cat sat on the mat. the cat sat on the", "x"],
                         [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), _p({"json": SCHEMA})])
    assert both[0].token_ids == alone.token_ids and json.loads(both[1].text)["tags"] is not None


@pytest.mark.parametrize("spec,why", [({"json": {"type": "nonsense"}}, "nonsense"), ({"regex": "(("}, "unclosed"),
                                      ({"grammar": "start: foo"}, "unknown name"), ({"json": 3}, "JSON schema"),
                                      ({"choice": []}, "non-empty list"), ({"json": {}, "regex": "a"}, "exactly one"),
                                      ({"xml": "a"}, "exactly one")])
def test_bad_specs_are_value_errors(llms, spec, why):
    with pytest.raises(ValueError, match=why):
        llms[0].generate(["x"], SamplingParams(structured_outputs=spec))


def test_forced_tool_calls_parse_as_hermes_calls_with_or_without_the_tag_tokens(llms):
    from rollwise.agent.parsing import HermesParser, forced_tool_calls
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"],
        "additionalProperties": False}}}]
    tag = llms[0].engine.tokenizer.added_token_id("<tool_call>")
    spec = forced_tool_calls(tools, {"type": "function", "function": {"name": "lookup"}}, tag_tokens=True)
    outs = llms[0].generate(["call:"] * 4, [_p(spec, seed=i, max_tokens=60) for i in range(4)])
    for o in outs:
        parsed = HermesParser().parse(o.text)
        assert o.finish_reason == "stop" and not parsed.errors and len(parsed.calls) == 1, o.text
        assert parsed.calls[0].name == "lookup" and len(parsed.calls[0].arguments["q"]) <= 5
        assert o.token_ids[0] == tag  # the tokenizer's own <tool_call>, as the model writes it
    # spelled out as text, the call cannot be written with this tokenizer (llguidance takes its
    # <tool_call> as a special token): the output ends at once rather than the engine failing
    [o] = llms[0].generate(["call:"], _p(forced_tool_calls(tools, "required", tag_tokens=False)))
    assert o.finish_reason == "stop" and o.text == "" and "no token can continue" in o.stop_reason


def test_forced_qwen3_coder_calls_parse_with_their_schemas_types(llms, model_dir):
    """tool_choice in Qwen3-Coder's XML format: a random model's forced calls parse, each value of
    its type (bounded integers, a boolean, an enum's word, an array of JSON); free text runs to a
    </parameter>, so code with angle brackets fits (checked on llguidance's matcher)."""
    from rollwise.agent.parsing import Qwen3CoderParser, forced_tool_calls
    props = {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "check": {"type": "boolean"},
             "mode": {"enum": ["fast", "exact"]}, "ids": {"type": "array", "items": {"type": "integer",
                                                                                   "minimum": 0, "maximum": 5},
                                                      "maxItems": 2}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}]
    parser = Qwen3CoderParser().for_tools(tools)
    tag = llms[0].engine.tokenizer.added_token_id("<tool_call>")
    spec = forced_tool_calls(tools, {"type": "function", "function": {"name": "add"}}, True, parser)
    outs = llms[0].generate(["call:"] * 4, [_p(spec, seed=i, max_tokens=200) for i in range(4)])
    for o in outs:
        parsed = parser.parse(o.text)
        assert o.finish_reason == "stop" and not parsed.errors and len(parsed.calls) == 1, o.text
        args = parsed.calls[0].arguments
        assert type(args["a"]) is int and 0 <= args["a"] <= 9 and type(args["check"]) is bool
        assert args["mode"] in ("fast", "exact") and all(0 <= i <= 5 for i in args["ids"]) and len(args["ids"]) <= 2
        assert o.token_ids[0] == tag
    assert len({o.text for o in outs}) > 1
    # free text: any text up to </parameter>
    edit = [{"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}, "line": {"type": "integer"}},
        "required": ["code"]}}}]
    accepts = _accepts(model_dir, forced_tool_calls(edit, "required", True, Qwen3CoderParser())["grammar"])
    code = 'if a < b:\n    print("</x> <parameter>!")'
    call = f"<tool_call>\n<function=edit>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>"
    assert accepts(call) and Qwen3CoderParser().for_tools(edit).parse(call).calls[0].arguments == {"code": code}
    assert accepts(call.replace("</function>", "<parameter=line>\n7\n</parameter>\n</function>"))
    assert not accepts(call.replace("</function>", "<parameter=line>\nseven\n</parameter>\n</function>"))
    assert not accepts(call.replace("<parameter>!", "</parameter>!"))  # (the parser would end the value there)


def test_forced_glm45_calls_parse_with_their_schemas_types(llms, model_dir):
    """tool_choice in GLM-4.5's format: a random model's forced calls parse, each value of its type;
    a string value is free text up to </arg_value> (checked on llguidance's matcher)."""
    from rollwise.agent.parsing import Glm45Parser, ToolCall, forced_tool_calls
    props = {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "check": {"type": "boolean"},
             "mode": {"enum": ["fast", "exact"]}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": props, "required": ["a", "check"]}}}]
    parser = Glm45Parser().for_tools(tools)
    spec = forced_tool_calls(tools, {"type": "function", "function": {"name": "add"}}, True, parser)  # (one call)
    outs = llms[0].generate(["call:"] * 4, [_p(spec, seed=i, max_tokens=120) for i in range(4)])
    for o in outs:
        parsed = parser.parse(o.text)
        assert o.finish_reason == "stop" and not parsed.errors and len(parsed.calls) == 1, o.text
        args = parsed.calls[0].arguments
        assert type(args["a"]) is int and 0 <= args["a"] <= 9 and type(args["check"]) is bool
        assert args.get("mode", "fast") in ("fast", "exact") and set(args) <= set(props)
    assert len({o.text for o in outs}) > 1
    # free text (a string's value): any text up to </arg_value> (a random model's would run on: the matcher's check)
    tools[0]["function"]["parameters"]["properties"]["note"] = {"type": "string"}
    parser = Glm45Parser().for_tools(tools)
    accepts = _accepts(model_dir, forced_tool_calls(tools, "required", True, parser)["grammar"])
    code = 'if a < b: print("</x>")'
    call = parser.write([ToolCall("add", {"a": 3, "check": False, "mode": "fast", "note": code})])
    assert accepts(call) and parser.parse(call).calls[0].arguments["note"] == code
    assert not accepts(call.replace("<arg_value>3<", "<arg_value>three<"))


def test_forced_pythonic_calls_keep_required_parameters_and_types(llms, model_dir):
    """tool_choice in the pythonic format: a random model's forced calls parse as Python, the required
    parameters always there, optional ones in order or left out, each value of its type."""
    from rollwise.agent.parsing import PythonicParser, forced_tool_calls
    props = {"check": {"type": "boolean"}, "a": {"type": "integer", "minimum": 0, "maximum": 9},
             "mode": {"enum": ["fast", "exact"]}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": props, "required": ["a"]}}}]
    parser = PythonicParser()
    spec = forced_tool_calls(tools, "required", False, parser)
    outs = llms[0].generate(["call:"] * 6, [_p(spec, seed=i, max_tokens=80) for i in range(6)])
    for o in outs:
        parsed = parser.parse(o.text)
        assert o.finish_reason == "stop" and not parsed.errors and parsed.calls, o.text
        for call in parsed.calls:
            args = call.arguments
            assert call.name == "add" and type(args["a"]) is int and 0 <= args["a"] <= 9 and set(args) <= set(props)
            assert type(args.get("check", False)) is bool and args.get("mode", "fast") in ("fast", "exact")
            assert list(args) == [k for k in props if k in args]  # schema order
    accepts = _accepts(model_dir, spec["grammar"])
    assert accepts("[add(a=1)]") and accepts('[add(check=True, a=1, mode="exact")]') and accepts("[add(a=1), add(a=2)]")
    assert not accepts('[add(mode="fast")]') and not accepts("[add(, a=1)]") and not accepts("[add(a=1, check=true)]")
