//! engram's `/metrics` page, read as numbers: counters summed over the series a filter keeps,
//! histograms merged over their other labels, and the difference between two scrapes. Pure.

/// One line of the text exposition format: `name{label="value",…} number`.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// A scrape of `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    samples: Vec<Sample>,
}

/// A histogram as cumulative bucket counts by upper bound (`+Inf` last), merged over every
/// label but `le`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub count: f64,
    pub sum: f64,
}

impl Scrape {
    pub fn parse(page: &str) -> Scrape {
        let samples = page
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .filter_map(parse_line)
            .collect();
        Scrape { samples }
    }

    /// Whether any series of `name` is on the page.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|s| s.name == name)
    }

    /// The sum of `name`'s series whose labels include every `(label, value)` of `filter`;
    /// `None` when the page has no series of that name.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        self.has(name).then(|| {
            self.samples
                .iter()
                .filter(|s| s.name == name && matches(s, filter))
                .map(|s| s.value)
                .sum()
        })
    }

    /// `name`'s series summed by the value of `label` (those without it under ""), keeping only
    /// series that match `filter`.
    pub fn by_label(&self, name: &str, label: &str, filter: &[(&str, &str)]) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = Vec::new();
        for s in self
            .samples
            .iter()
            .filter(|s| s.name == name && matches(s, filter))
        {
            let key = s
                .labels
                .iter()
                .find(|(k, _)| k == label)
                .map_or(String::new(), |(_, v)| v.clone());
            match out.iter_mut().find(|(k, _)| *k == key) {
                Some((_, total)) => *total += s.value,
                None => out.push((key, s.value)),
            }
        }
        out
    }

    /// The histogram `name` (its `_bucket`, `_count` and `_sum` series), merged over every
    /// label but `le`; `None` when the page does not have it.
    pub fn histogram(&self, name: &str) -> Option<Histogram> {
        self.histogram_of(name, &[])
    }

    /// [`Scrape::histogram`] over the series with the labels of `filter` only.
    pub fn histogram_of(&self, name: &str, filter: &[(&str, &str)]) -> Option<Histogram> {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for s in self
            .samples
            .iter()
            .filter(|s| s.name == bucket && matches(s, filter))
        {
            let Some(le) = s
                .labels
                .iter()
                .find(|(k, _)| k == "le")
                .and_then(|(_, v)| parse_number(v))
            else {
                continue;
            };
            match buckets.iter_mut().find(|(bound, _)| *bound == le) {
                Some((_, count)) => *count += s.value,
                None => buckets.push((le, s.value)),
            }
        }
        if buckets.is_empty() {
            return None;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Histogram {
            buckets,
            count: self.sum(&format!("{name}_count"), filter).unwrap_or(0.0),
            sum: self.sum(&format!("{name}_sum"), filter).unwrap_or(0.0),
        })
    }
}

fn matches(sample: &Sample, filter: &[(&str, &str)]) -> bool {
    filter
        .iter()
        .all(|(k, v)| sample.labels.iter().any(|(sk, sv)| sk == k && sv == v))
}

fn parse_number(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => text.parse().ok(),
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let (series, value) = if line.contains('{') {
        let close = line.rfind('}')?;
        (&line[..=close], line[close + 1..].trim())
    } else {
        let (name, rest) = line.split_once(char::is_whitespace)?;
        (name, rest.trim())
    };
    // A timestamp may follow the value.
    let value = parse_number(value.split_whitespace().next()?)?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)),
        None => (series, Vec::new()),
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// `a="x",b="y \"q\""` → pairs, with `\"`, `\\` and `\n` unescaped.
fn parse_labels(text: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once('=') {
        let key = key.trim().trim_start_matches(',').trim().to_owned();
        let Some(after) = after.trim_start().strip_prefix('"') else {
            break;
        };
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((at, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, other)) => value.push(other),
                    None => {}
                },
                '"' => {
                    end = at + 1;
                    break;
                }
                other => value.push(other),
            }
        }
        labels.push((key, value));
        rest = &after[end..];
    }
    labels
}

impl Histogram {
    /// `self` less `earlier` (the same histogram scraped before), bucket by bucket.
    pub fn since(&self, earlier: Option<&Histogram>) -> Histogram {
        let Some(earlier) = earlier else {
            return self.clone();
        };
        let before = |bound: f64| {
            earlier
                .buckets
                .iter()
                .find(|(b, _)| *b == bound)
                .map_or(0.0, |(_, c)| *c)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(bound, count)| (bound, (count - before(bound)).max(0.0)))
                .collect(),
            count: (self.count - earlier.count).max(0.0),
            sum: self.sum - earlier.sum,
        }
    }

    /// Observations in all.
    pub fn total(&self) -> f64 {
        self.buckets
            .last()
            .map_or(self.count, |(_, count)| count.max(self.count))
    }

    /// The `q` quantile (0-1): the bucket it falls in, and Prometheus's `histogram_quantile`
    /// estimate (linear within that bucket, from 0 for the first). Past the largest finite
    /// bound the bucket is open (`upper` infinite). `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<Quantile> {
        self.quantile_with_unobserved(q, 0, 0.0)
    }

    /// The `q` quantile counting `unobserved` more observations known only to be at least
    /// `at_least` (jobs not applied by the time the histogram was read, say).
    pub fn quantile_with_unobserved(
        &self,
        q: f64,
        unobserved: u64,
        at_least: f64,
    ) -> Option<Quantile> {
        let observed = self.total();
        let all = observed + unobserved as f64;
        if all <= 0.0 {
            return None;
        }
        let rank = q * all;
        if rank > observed {
            return Some(Quantile::open(at_least));
        }
        let mut previous = (0.0, 0.0);
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return Some(Quantile::open(previous.0));
                }
                let within = count - previous.1;
                let share = if within > 0.0 {
                    (rank - previous.1) / within
                } else {
                    1.0
                };
                return Some(Quantile {
                    estimate: previous.0 + (bound - previous.0) * share,
                    lower: previous.0,
                    upper: bound,
                });
            }
            previous = (bound, count);
        }
        Some(Quantile::open(previous.0))
    }

    /// The bucket of the largest observation: every one was at most its upper bound. With
    /// `unobserved` more, at least `at_least`, the largest is open above that.
    pub fn max_bound(&self, unobserved: u64, at_least: f64) -> Option<Quantile> {
        if unobserved > 0 {
            return Some(Quantile::open(at_least));
        }
        let total = self.total();
        if total <= 0.0 {
            return None;
        }
        let mut previous = 0.0;
        for &(bound, count) in &self.buckets {
            if count >= total {
                return Some(if bound.is_infinite() {
                    Quantile::open(previous)
                } else {
                    Quantile {
                        estimate: bound,
                        lower: previous,
                        upper: bound,
                    }
                });
            }
            previous = bound;
        }
        None
    }

    /// The share of observations at or below `threshold` when it is a bucket bound (exact),
    /// else `None`.
    pub fn share_within(&self, threshold: f64) -> Option<f64> {
        let total = self.total();
        let (_, count) = self
            .buckets
            .iter()
            .find(|(bound, _)| (*bound - threshold).abs() < threshold * 1e-9)?;
        (total > 0.0).then(|| count / total)
    }
}

/// A quantile read from a histogram: the bucket it falls in, and an estimate within it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Quantile {
    /// Linear within the bucket (Prometheus's `histogram_quantile`); `lower` when open.
    pub estimate: f64,
    pub lower: f64,
    /// Infinite when the bucket is open: the true value is only known to be above `lower`.
    pub upper: f64,
}

impl Quantile {
    fn open(lower: f64) -> Quantile {
        Quantile {
            estimate: lower,
            lower,
            upper: f64::INFINITY,
        }
    }

    pub fn is_open(&self) -> bool {
        self.upper.is_infinite()
    }
}
