//! The engine's own small error type: a chat request the wire types cannot parse or accept,
//! and an upstream body they could not write. The sidecar converts it into its one error type
//! (`From`), which alone says a status and renders a response at the HTTP boundary.

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("We could not parse the JSON body of your request: {message}")]
    InvalidJson {
        message: String,
        /// Dotted path of the offending field, when the JSON was well-formed but a field was not.
        param: Option<String>,
    },
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    pub fn invalid_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Error::InvalidRequest {
            message: message.into(),
            param: param.map(str::to_owned),
        }
    }
}

/// Parses a JSON body, naming the byte position or, for a well-formed body, the field path of
/// the first problem; anything but whitespace after the value is an error.
pub fn decode_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T> {
    let deserializer = &mut serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut *deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        let param = (path != "." && !inner.is_syntax() && !inner.is_eof()).then_some(path);
        Error::InvalidJson {
            message: inner.to_string(),
            param,
        }
    })?;
    // Anything but whitespace after the value is malformed: it would be dropped unseen when
    // the body is rewritten, or reach an upstream that reads it differently.
    deserializer.end().map_err(|error| Error::InvalidJson {
        message: error.to_string(),
        param: None,
    })?;
    Ok(value)
}
