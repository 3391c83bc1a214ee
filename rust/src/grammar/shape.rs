//! Shape checks run before llguidance sees a grammar: llguidance compiles by recursion (a `$ref`
//! compiles its target inside the caller's frame, an object's properties are joined one frame
//! per property, a Lark rule compiles the rules it names), so a deep enough input overflows any
//! stack. Bounding the depth here turns that into an error naming the limit, and bounds the
//! stack the compile thread needs (see `compile::STACK_SIZE`). Quadratic shapes llguidance cannot
//! interrupt (pairwise `patternProperties` disjointness) are bounded here too.

use std::collections::HashMap;

use llguidance::api::TopLevelGrammar;
use serde_json::Value;

/// The largest shapes accepted. Each is far above what hand-written schemas and grammars use
/// (OpenAI's structured outputs allow 10 nesting levels and 5000 properties in all).
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeLimits {
    /// Schema values on the longest path from the root, following `$ref`s: nesting levels
    /// count (a property of a property is 4 values deeper: two schemas, two `properties`).
    pub max_schema_depth: usize,
    /// Properties of one object schema (`properties` and `required` names together).
    pub max_object_properties: usize,
    /// Pairs of `patternProperties` regexes llguidance checks for overlap, summed over objects.
    pub max_pattern_pairs: usize,
    /// Rules on the longest chain of Lark rule (and terminal) references.
    pub max_lark_depth: usize,
}

impl Default for ShapeLimits {
    fn default() -> Self {
        Self {
            max_schema_depth: 256,
            max_object_properties: 5000,
            // 100 patterns in one object: 0.06 s, 200: 1.8 s, 500: minutes (quadratic and more).
            max_pattern_pairs: 5000,
            max_lark_depth: 1000,
        }
    }
}

/// Err(reason) when `grammar` is outside `limits`.
pub fn check(grammar: &TopLevelGrammar, limits: &ShapeLimits) -> Result<(), String> {
    for g in &grammar.grammars {
        if let Some(schema) = &g.json_schema {
            check_schema(schema, limits)?;
        }
        if let Some(lark) = &g.lark_grammar {
            check_lark(lark, limits)?;
        }
    }
    Ok(())
}

/// A directed graph on `0..n`; `depth` is the number of nodes on its longest path where a cycle
/// counts all of its nodes once (strongly connected components weighted by size): an upper bound
/// on the recursion depth of any traversal that visits each node at most once per stack.
struct Graph {
    edges: Vec<Vec<usize>>,
}

impl Graph {
    fn new(n: usize) -> Self {
        Self {
            edges: vec![Vec::new(); n],
        }
    }

    fn depth(&self) -> usize {
        let comp = self.components();
        let ncomp = comp.iter().map(|&c| c + 1).max().unwrap_or(0);
        let mut size = vec![0usize; ncomp];
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); ncomp];
        for (v, &c) in comp.iter().enumerate() {
            size[c] += 1;
            members[c].push(v);
        }
        // Tarjan numbers components in reverse topological order: every edge leaving component
        // c goes to a lower number, so ascending order sees successors first.
        let mut best = vec![0usize; ncomp];
        for c in 0..ncomp {
            let mut next = 0;
            for &v in &members[c] {
                for &w in &self.edges[v] {
                    if comp[w] != c {
                        next = next.max(best[comp[w]]);
                    }
                }
            }
            best[c] = size[c] + next;
        }
        best.into_iter().max().unwrap_or(0)
    }

    /// Tarjan's strongly connected components, iteratively (the input may be deep).
    fn components(&self) -> Vec<usize> {
        const NONE: usize = usize::MAX;
        let n = self.edges.len();
        let (mut index, mut low, mut comp) = (vec![NONE; n], vec![0; n], vec![NONE; n]);
        let (mut stack, mut on_stack) = (Vec::new(), vec![false; n]);
        let (mut next_index, mut next_comp) = (0, 0);
        for root in 0..n {
            if index[root] != NONE {
                continue;
            }
            let mut work: Vec<(usize, usize)> = vec![(root, 0)];
            while let Some(&mut (v, ref mut i)) = work.last_mut() {
                if *i == 0 {
                    index[v] = next_index;
                    low[v] = next_index;
                    next_index += 1;
                    stack.push(v);
                    on_stack[v] = true;
                }
                if let Some(&w) = self.edges[v].get(*i) {
                    *i += 1;
                    if index[w] == NONE {
                        work.push((w, 0));
                    } else if on_stack[w] {
                        low[v] = low[v].min(index[w]);
                    }
                    continue;
                }
                work.pop();
                if let Some(&(parent, _)) = work.last() {
                    low[parent] = low[parent].min(low[v]);
                }
                if low[v] == index[v] {
                    while let Some(w) = stack.pop() {
                        on_stack[w] = false;
                        comp[w] = next_comp;
                        if w == v {
                            break;
                        }
                    }
                    next_comp += 1;
                }
            }
        }
        comp
    }
}

fn check_schema(root: &Value, limits: &ShapeLimits) -> Result<(), String> {
    // Every object and array of the schema is a node; its edges go to its children and, for a
    // local `$ref`, to the referenced value.
    let mut ids: HashMap<*const Value, usize> = HashMap::new();
    let mut nodes: Vec<&Value> = Vec::new();
    let mut todo = vec![root];
    while let Some(v) = todo.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Object(m) => Box::new(m.values()),
            Value::Array(a) => Box::new(a.iter()),
            _ => continue,
        };
        ids.insert(v as *const Value, nodes.len());
        nodes.push(v);
        todo.extend(children.filter(|c| c.is_object() || c.is_array()));
    }
    let mut graph = Graph::new(nodes.len());
    let mut pattern_pairs = 0usize;
    for (id, v) in nodes.iter().enumerate() {
        let children: Vec<&Value> = match v {
            Value::Object(m) => m.values().collect(),
            Value::Array(a) => a.iter().collect(),
            _ => Vec::new(),
        };
        for c in children {
            if let Some(&cid) = ids.get(&(c as *const Value)) {
                graph.edges[id].push(cid);
            }
        }
        let Value::Object(m) = v else { continue };
        if let Some(target) = m
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| resolve(root, r))
        {
            if let Some(&tid) = ids.get(&(target as *const Value)) {
                graph.edges[id].push(tid);
            }
        }
        let mut names: Vec<&str> = Vec::new();
        if let Some(Value::Object(p)) = m.get("properties") {
            names.extend(p.keys().map(String::as_str));
        }
        if let Some(Value::Array(r)) = m.get("required") {
            names.extend(r.iter().filter_map(Value::as_str));
        }
        if names.len() > limits.max_object_properties {
            names.sort_unstable();
            names.dedup();
            if names.len() > limits.max_object_properties {
                return Err(format!(
                    "an object schema has {} properties (properties and required together; \
                     limit {})",
                    names.len(),
                    limits.max_object_properties
                ));
            }
        }
        if let Some(Value::Object(p)) = m.get("patternProperties") {
            let n = p.len();
            pattern_pairs = pattern_pairs.saturating_add(n * n.saturating_sub(1) / 2);
            if pattern_pairs > limits.max_pattern_pairs {
                return Err(format!(
                    "too many patternProperties: their regexes are checked pairwise for overlap, \
                     {pattern_pairs} pairs so far (limit {}; e.g. 100 patterns in one object)",
                    limits.max_pattern_pairs
                ));
            }
        }
    }
    let depth = graph.depth();
    if depth > limits.max_schema_depth {
        return Err(format!(
            "the schema is {depth} levels deep, counting nesting and $ref chains (limit {})",
            limits.max_schema_depth
        ));
    }
    Ok(())
}

/// The value a local `$ref` ("#", "#/$defs/a", percent-escapes and ~0/~1) points at. Anchors,
/// `$id`-relative and remote references are not followed: llguidance resolves those itself, and
/// they cannot form a chain of local definitions.
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    let decoded = percent_decode(pointer)?;
    root.pointer(&decoded)
}

fn percent_decode(s: &str) -> Option<String> {
    if !s.contains('%') {
        return Some(s.to_owned());
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Lark: the rule-reference graph (rules and terminals by name), and every `%json {...}` schema
/// inside, checked as schemas.
fn check_lark(text: &str, limits: &ShapeLimits) -> Result<(), String> {
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut refs: Vec<(usize, &str)> = Vec::new();
    let mut current: Option<usize> = None;
    let b = text.as_bytes();
    let mut i = 0;
    let mut line_start = true;
    while i < b.len() {
        let c = b[i];
        match c {
            b'\n' => {
                line_start = true;
                i += 1;
                continue;
            }
            b' ' | b'\t' | b'\r' => {
                i += 1;
                continue;
            }
            b'/' if b.get(i + 1) == Some(&b'/') => i = skip_line(b, i),
            b'#' => i = skip_line(b, i),
            b'"' | b'\'' => i = skip_quoted(b, i, c),
            b'/' => i = skip_quoted(b, i, b'/'),
            b'<' => i = skip_until(b, i, b'>'),
            b'%' => {
                let start = i + 1;
                let end = ident_end(b, start);
                let directive = &text[start..end];
                i = end;
                match directive {
                    "json" | "regex" | "llguidance" => {
                        while i < b.len() && b[i].is_ascii_whitespace() {
                            i += 1;
                        }
                        if b.get(i) == Some(&b'{') {
                            let mut it =
                                serde_json::Deserializer::from_str(&text[i..]).into_iter::<Value>();
                            match it.next() {
                                Some(Ok(v)) => {
                                    if directive == "json" {
                                        check_schema(&v, limits)?;
                                    }
                                    i += it.byte_offset();
                                }
                                // Let llguidance report the syntax error.
                                _ => return Ok(()),
                            }
                        }
                    }
                    "import" => i = skip_line(b, i),
                    // %ignore and the like: references outside any rule.
                    _ => current = None,
                }
            }
            c if c == b'_' || c.is_ascii_alphabetic() => {
                let end = ident_end(b, i);
                let name = &text[i..end];
                let after = definition_colon(b, end);
                if line_start && after.is_some() {
                    let n = names.len();
                    current = Some(*names.entry(name).or_insert(n));
                    i = after.unwrap_or(end);
                } else {
                    if let Some(cur) = current {
                        refs.push((cur, name));
                    }
                    i = end;
                }
            }
            b'?' | b'!' if line_start => {
                i += 1;
                continue; // the rule name that follows still starts the line
            }
            _ => i += 1,
        }
        line_start = false;
    }
    let mut graph = Graph::new(names.len());
    for (from, name) in refs {
        if let Some(&to) = names.get(name) {
            graph.edges[from].push(to);
        }
    }
    let depth = graph.depth();
    if depth > limits.max_lark_depth {
        return Err(format!(
            "the grammar's rules reference each other {depth} deep (limit {})",
            limits.max_lark_depth
        ));
    }
    Ok(())
}

fn ident_end(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
        i += 1;
    }
    i
}

fn skip_line(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i] != b'\n' {
        i += 1;
    }
    i
}

/// Past the closing `quote` (backslash escapes), or at the end of the line if there is none.
fn skip_quoted(b: &[u8], mut i: usize, quote: u8) -> usize {
    i += 1;
    while i < b.len() && b[i] != b'\n' {
        match b[i] {
            b'\\' => i += 2,
            c if c == quote => return i + 1,
            _ => i += 1,
        }
    }
    i.min(b.len())
}

fn skip_until(b: &[u8], mut i: usize, end: u8) -> usize {
    while i < b.len() && b[i] != b'\n' {
        i += 1;
        if b[i - 1] == end {
            break;
        }
    }
    i
}

/// After a name at the start of a line: `.priority`, `[attributes]`, blanks, then `:` make it a
/// definition; returns the position past the colon.
fn definition_colon(b: &[u8], mut i: usize) -> Option<usize> {
    if b.get(i) == Some(&b'.') {
        i += 1;
        while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'-') {
            i += 1;
        }
    }
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    if b.get(i) == Some(&b'[') {
        while i < b.len() && b[i] != b']' && b[i] != b'\n' {
            i = match b[i] {
                q @ (b'"' | b'\'') => skip_quoted(b, i, q),
                _ => i + 1,
            };
        }
        i += 1;
    }
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    (b.get(i) == Some(&b':')).then_some(i + 1)
}

#[cfg(test)]
#[path = "shape_tests.rs"]
mod tests;
