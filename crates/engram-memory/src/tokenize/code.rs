//! Fenced code in text: which lines are fences, the blocks they delimit, and the text without
//! them.

/// What follows the backticks of a code fence line (one that starts, after any indentation,
/// with three backticks), or `None` for any other line. Every line that does opens or closes a
/// fenced block: the one rule extraction, artifacts and rendering all read code by.
pub fn fence_info(line: &str) -> Option<&str> {
    line.trim_start().strip_prefix("```")
}

/// Fenced (```) code blocks, in order: `(language, code)`. An unclosed fence runs to the end.
pub fn code_blocks(text: &str) -> Vec<(Option<String>, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(Option<String>, Vec<&str>)> = None;
    for line in text.lines() {
        if let Some(info) = fence_info(line) {
            match current.take() {
                Some((language, lines)) => blocks.push((language, lines.join("\n"))),
                None => {
                    let language = info
                        .split_whitespace()
                        .next()
                        .map(str::to_lowercase)
                        .filter(|language| !language.is_empty());
                    current = Some((language, Vec::new()));
                }
            }
        } else if let Some((_, lines)) = current.as_mut() {
            lines.push(line);
        }
    }
    if let Some((language, lines)) = current {
        blocks.push((language, lines.join("\n")));
    }
    blocks.retain(|(_, code)| !code.trim().is_empty());
    blocks
}

/// `text` with each fenced code block replaced by `[code]`, for summaries.
pub fn without_code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_code = false;
    for line in text.lines() {
        if fence_info(line).is_some() {
            if !in_code {
                out.push_str(" [code] ");
            }
            in_code = !in_code;
            continue;
        }
        if !in_code {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_blocks_are_kept_whole_with_their_language() {
        let text = "Here:\n```Rust\nfn a() {\n    1\n}\n```\nand\n```\nplain\n```\n";
        assert_eq!(
            code_blocks(text),
            [
                (Some("rust".to_string()), "fn a() {\n    1\n}".to_string()),
                (None, "plain".to_string())
            ]
        );
        assert_eq!(
            without_code(text).split_whitespace().collect::<Vec<_>>(),
            ["Here:", "[code]", "and", "[code]"]
        );
    }
}
