//! Text to token ids through a Hugging Face `tokenizer.json`, adding BOS/EOS as torchtitan's
//! `HuggingFaceTokenizer.encode(text, add_bos=True, add_eos=True)` does.

use std::path::Path;

use anyhow::{Context, Result, bail};

/// The byte-level BPE tokenizer embedded in titan-train (vocab <= 2048, made by
/// `trainer/assets/make_default_data.py`).
const EMBEDDED_TOKENIZER: &str = include_str!("../../assets/tokenizer.json");

/// Special-token spellings tried, in order, when `tokenizer_config.json` does not name them.
const BOS_CANDIDATES: &[&str] = &["<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]"];
const EOS_CANDIDATES: &[&str] = &[
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|endoftext|>",
    "<|eos|>",
    "[EOS]",
];

/// A tokenizer plus the ids it wraps documents with.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
}

impl TextTokenizer {
    /// The tokenizer shipped inside the binary.
    pub fn embedded() -> Result<Self> {
        let inner = EMBEDDED_TOKENIZER
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| anyhow::anyhow!("embedded tokenizer: {e}"))?;
        Self::with_special_tokens(inner, None, None)
    }

    /// `tokenizer.json` from `dir` (torchtitan's `model.hf_assets_path`); BOS/EOS come from
    /// `tokenizer_config.json` when present, else from well-known special-token spellings.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let file = dir.join("tokenizer.json");
        if !file.exists() {
            bail!(
                "no tokenizer.json in {} (model.hf_assets_path); leave model.hf_assets_path empty for the embedded tokenizer",
                dir.display()
            );
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", file.display()))?;
        let (mut bos, mut eos) = (None, None);
        let config = dir.join("tokenizer_config.json");
        if config.exists() {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", config.display()))?;
            let token = |key: &str| match &json[key] {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string),
                _ => None,
            };
            bos = token("bos_token");
            eos = token("eos_token");
        }
        Self::with_special_tokens(inner, bos, eos)
    }

    fn with_special_tokens(
        inner: tokenizers::Tokenizer,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self> {
        let find = |named: Option<String>, candidates: &[&str]| -> Result<Option<u32>> {
            if let Some(name) = named {
                return match inner.token_to_id(&name) {
                    Some(id) => Ok(Some(id)),
                    None => bail!(
                        "special token `{name}` from tokenizer_config.json is not in the vocabulary"
                    ),
                };
            }
            Ok(candidates.iter().find_map(|c| inner.token_to_id(c)))
        };
        let bos_id = find(bos, BOS_CANDIDATES)?;
        let eos_id = find(eos, EOS_CANDIDATES)?;
        Ok(Self {
            inner,
            bos_id,
            eos_id,
        })
    }

    /// Number of ids the tokenizer can produce (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// `[BOS] + ids(text) + [EOS]` (each special token only when the tokenizer has one).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("tokenizing failed: {e}"))?;
        let mut ids = Vec::with_capacity(enc.len() + 2);
        ids.extend(self.bos_id);
        ids.extend_from_slice(enc.get_ids());
        ids.extend(self.eos_id);
        Ok(ids)
    }

    /// Token ids back to text (for debugging and tests).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow::anyhow!("decoding failed: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_tokenizer_round_trips_with_bos_eos() {
        let t = TextTokenizer::embedded().unwrap();
        assert!(t.vocab_size() <= 2048);
        let ids = t.encode("Once upon a time there was a cat.").unwrap();
        assert_eq!(ids.first().copied(), t.bos_id);
        assert_eq!(ids.last().copied(), t.eos_id);
        assert!(t.bos_id.is_some() && t.eos_id.is_some());
        let text = t.decode(&ids[1..ids.len() - 1]).unwrap();
        assert_eq!(text, "Once upon a time there was a cat.");
    }
}
