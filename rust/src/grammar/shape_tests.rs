use super::*;
use crate::grammar::compile::STACK_SIZE;
use crate::grammar::{CompileError, GrammarCompiler, GrammarLimits, Vocab};

fn limits() -> ShapeLimits {
    ShapeLimits::default()
}

fn schema(text: &str) -> Result<(), String> {
    check_schema(&serde_json::from_str(text).unwrap(), &limits())
}

/// `{"$ref": d0}`, d_i -> d_{i+1}, d_n an integer: n + 3 values deep.
fn ref_chain(n: usize) -> String {
    let defs: Vec<String> = (0..n)
        .map(|i| format!(r##""d{i}": {{"$ref": "#/$defs/d{}"}}"##, i + 1))
        .chain([format!(r#""d{n}": {{"type": "integer"}}"#)])
        .collect();
    format!(
        r##"{{"$ref": "#/$defs/d0", "$defs": {{{}}}}}"##,
        defs.join(", ")
    )
}

fn object(n: usize) -> String {
    let props: Vec<String> = (0..n)
        .map(|i| format!(r#""p{i}": {{"type": "integer"}}"#))
        .collect();
    let req: Vec<String> = (0..n).map(|i| format!(r#""p{i}""#)).collect();
    format!(
        r#"{{"type": "object", "properties": {{{}}}, "required": [{}]}}"#,
        props.join(", "),
        req.join(", ")
    )
}

fn lark_chain(n: usize, upper: bool) -> String {
    let name = |i: usize| {
        if upper {
            format!("R{i}")
        } else {
            format!("r{i}")
        }
    };
    let mut g = format!("start: {}\n", name(0));
    for i in 0..n {
        g.push_str(&format!("{}: {}\n", name(i), name(i + 1)));
    }
    g.push_str(&format!("{}: \"x\"\n", name(n)));
    g
}

#[test]
fn grammar_shape_ref_chains() {
    let max = limits().max_schema_depth;
    assert!(schema(&ref_chain(max - 3)).is_ok());
    let err = schema(&ref_chain(1000)).unwrap_err();
    assert!(err.contains("levels deep") && err.contains("256"), "{err}");
    // Recursion through a cycle counts each schema once.
    let tree = r##"{"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties":
        {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}"##;
    assert!(schema(tree).is_ok());
    assert!(schema(r##"{"$ref": "#"}"##).is_ok());
    // Escaped pointers resolve too.
    let esc = (0..300)
        .map(|i| format!(r##""a/{i}": {{"$ref": "#/$defs/a~1{}"}}"##, i + 1))
        .collect::<Vec<_>>()
        .join(", ");
    let esc = format!(r##"{{"$ref": "#/$defs/a~10", "$defs": {{{esc}}}}}"##);
    assert!(schema(&esc).is_err());
}

#[test]
fn grammar_shape_order_does_not_hide_a_chain() {
    // The root names the chain's links last-first: a traversal that remembers finished
    // definitions would recurse only 2 deep this way, llguidance's order may still go n deep.
    let n = 400;
    let any: Vec<String> = (0..=n)
        .rev()
        .map(|i| format!(r##"{{"$ref": "#/$defs/d{i}"}}"##))
        .collect();
    let chain = ref_chain(n);
    let s = format!(r#"{{"anyOf": [{}], {}"#, any.join(", "), &chain[1..]);
    assert!(schema(&s).is_err());
}

#[test]
fn grammar_shape_properties_and_patterns() {
    assert!(schema(&object(5000)).is_ok());
    let err = schema(&object(5001)).unwrap_err();
    assert!(err.contains("5001 properties"), "{err}");
    let required: Vec<String> = (0..6000).map(|i| format!(r#""p{i}""#)).collect();
    let only = format!(
        r#"{{"type": "object", "required": [{}]}}"#,
        required.join(",")
    );
    assert!(schema(&only).is_err());
    let pats = |n: usize| {
        let p: Vec<String> = (0..n)
            .map(|i| format!(r#""^k{i}_[a-z]*$": {{"type": "integer"}}"#))
            .collect();
        format!(
            r#"{{"type": "object", "patternProperties": {{{}}}}}"#,
            p.join(",")
        )
    };
    assert!(schema(&pats(100)).is_ok());
    let err = schema(&pats(500)).unwrap_err();
    assert!(err.contains("patternProperties"), "{err}");
}

fn lark(text: &str) -> Result<(), String> {
    check_lark(text, &limits())
}

#[test]
fn grammar_shape_lark_chains() {
    assert!(lark(&lark_chain(998, false)).is_ok());
    assert!(lark(&lark_chain(999, false)).is_err());
    let err = lark(&lark_chain(10_000, false)).unwrap_err();
    assert!(err.contains("1000"), "{err}");
    assert!(lark(&lark_chain(10_000, true)).is_err());
    // Names inside strings, regexes, comments and special tokens are not references.
    let mut g = String::from("start: a\n");
    for i in 0..2000 {
        g.push_str(&format!(
            "a{i}: \"a{} b\" /a{}/ <|a{}|> // a{}\n",
            i + 1,
            i + 1,
            i + 1,
            i + 1
        ));
    }
    assert!(lark(&g).is_ok());
    // A usual grammar: priorities, attributes, continuation lines, recursion, %ignore.
    let expr = r#"
?start: expr
expr: term (("+" | "-") term)*
    | "-" expr
term.2: factor (("*" | "/") factor)*
factor[capture]: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
%ignore /[ \t]+/
"#;
    assert!(lark(expr).is_ok());
    let deep = format!("start: %json {}\n", ref_chain(1000));
    assert!(lark(&deep).unwrap_err().contains("levels deep"));
}

fn compiler() -> GrammarCompiler {
    let mut w: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
    w.push(Some(b"</s>".to_vec()));
    let vocab = Vocab::new(&w, &[256], &[256], 260).unwrap();
    GrammarCompiler::new(vocab, GrammarLimits::default()).unwrap()
}

/// Bytes of its thread's stack `f` touched: the resident size of the stack mapping after it
/// ran on a fresh `STACK_SIZE` thread (Linux: /proc/self/smaps).
fn stack_touched<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> (T, usize) {
    std::thread::Builder::new()
        .stack_size(STACK_SIZE)
        .spawn(move || {
            let out = f();
            let here = &out as *const T as usize;
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            let mut inside = false;
            for line in smaps.lines() {
                let range = line.split_whitespace().next().unwrap_or("");
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) =
                        (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                    {
                        inside = (a..b).contains(&here);
                        continue;
                    }
                }
                if inside {
                    if let Some(kb) = line.strip_prefix("Rss:") {
                        let kb: usize = kb.trim().trim_end_matches("kB").trim().parse().unwrap();
                        return (out, kb << 10);
                    }
                }
            }
            panic!("no stack mapping found")
        })
        .unwrap()
        .join()
        .unwrap()
}

fn json(schema: &str) -> String {
    format!(r#"{{"grammars": [{{"json_schema": {schema}}}]}}"#)
}

/// The deepest input of each shape the limits accept compiles within half the compile
/// thread's stack, in debug and release builds (`STACK_SIZE` cites these numbers).
#[test]
fn grammar_shape_deepest_accepted_inputs_fit_the_stack() {
    let max = limits().max_schema_depth;
    // A chain of refs ending in the largest object: both recursions on one stack.
    let chain_then_object = {
        let c = ref_chain(max - 5);
        let last = format!(r#""d{}": {{"type": "integer"}}"#, max - 5);
        c.replace(&last, &format!(r#""d{}": {}"#, max - 5, object(5000)))
    };
    let mut nested = String::from(r#"{"type": "integer"}"#);
    for _ in 0..60 {
        nested = format!(r#"{{"type": "array", "items": {nested}}}"#);
    }
    let cases = [
        ("ref chain", json(&ref_chain(max - 3))),
        ("properties", json(&object(5000))),
        ("ref chain + properties", json(&chain_then_object)),
        ("nesting", json(&nested)),
        ("lark rules", lark_chain(998, false)),
        ("lark terminals", lark_chain(998, true)),
    ];
    let c = compiler();
    for (name, text) in cases {
        let c = c.clone();
        let (r, used) = stack_touched(move || c.build_here(&text));
        eprintln!("{name}: {} KiB of stack", used >> 10);
        if let Err(CompileError::Grammar(e)) = &r {
            // Rejected by llguidance's own limits (grammar size, fuel) is fine too: it ran.
            eprintln!("  ({e})");
        }
        assert!(used < STACK_SIZE / 2, "{name}: {used} bytes");
    }
}
