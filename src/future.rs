//! The boxed future of the object-safe traits (the store, the memory layer): at the bottom, so
//! every layer can name it without importing the one above.

use std::future::Future;
use std::pin::Pin;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
