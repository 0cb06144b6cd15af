use super::*;

/// Seeded xorshift64*: tests stay deterministic without a rand dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const ALPHABET: [&str; 6] = ["a", "b", "é", "日", "🎉", " "];

fn random_string(rng: &mut Rng, max_chars: usize) -> String {
    let n = rng.below(max_chars + 1);
    (0..n)
        .map(|_| ALPHABET[rng.below(ALPHABET.len())])
        .collect()
}

/// Feed `deltas`, then finish unless stopped; return (joined output, stop).
fn stream(stops: &[String], deltas: &[&str]) -> (String, Option<String>) {
    let mut m = StopMatcher::new(stops);
    let mut out = String::new();
    let mut stop = None;
    for d in deltas {
        let step = m.feed(d);
        out.push_str(&step.release);
        if step.stopped.is_some() {
            assert!(stop.is_none(), "stopped twice");
            stop = step.stopped;
        }
    }
    if stop.is_none() {
        out.push_str(&m.finish());
    }
    (out, stop)
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn alphabet_case_from_b06() {
    let stops = strings(&["DEFGHIJ"]);
    let mut m = StopMatcher::new(&stops);
    assert_eq!(m.feed("ABC").release, "ABC");
    assert_eq!(m.feed("D").release, "");
    assert_eq!(m.feed("EF").release, "");
    assert_eq!(m.held(), "DEF");
    let step = m.feed("GHIJKL");
    assert_eq!(
        step,
        StopStep {
            release: String::new(),
            stopped: Some("DEFGHIJ".into())
        }
    );
    assert!(m.is_stopped());
    assert_eq!(m.feed("more"), StopStep::default());
    assert_eq!(m.finish(), "");
}

#[test]
fn held_text_is_released_on_finish() {
    let stops = strings(&["beta gamma"]);
    let mut m = StopMatcher::new(&stops);
    assert_eq!(m.feed("alpha be").release, "alpha ");
    assert_eq!(m.feed("ta").release, "");
    assert_eq!(m.finish(), "beta");
    // A near-miss releases as soon as it cannot match.
    let mut m = StopMatcher::new(&stops);
    assert_eq!(m.feed("beta g").release, "");
    assert_eq!(m.feed("x").release, "beta gx");
}

#[test]
fn match_across_many_deltas_and_non_ascii() {
    let stops = strings(&["日本🎉"]);
    assert_eq!(
        stream(&stops, &["x日", "本", "🎉tail"]),
        ("x".into(), Some("日本🎉".into()))
    );
    assert_eq!(stream(&stops, &["日本", "é"]), ("日本é".into(), None));
    // Earliest end wins; the longest match among those ending there.
    let stops = strings(&["abcd", "bc"]);
    assert_eq!(apply_stop(&stops, "abcd"), ("a".into(), Some("bc".into())));
    let stops = strings(&["c", "bc"]);
    assert_eq!(apply_stop(&stops, "abc"), ("a".into(), Some("bc".into())));
    assert_eq!(
        stream(&stops, &["ab", "c"]),
        ("a".into(), Some("bc".into()))
    );
}

#[test]
fn no_stops_passes_through() {
    let mut m = StopMatcher::new(&strings(&["", ""]));
    assert_eq!(m.feed("abc").release, "abc");
    assert_eq!(m.finish(), "");
    assert_eq!(apply_stop(&[], "x"), ("x".into(), None));
}

#[test]
fn random_splits_match_one_shot() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..20_000 {
        let stops: Vec<String> = (0..rng.below(4))
            .map(|_| random_string(&mut rng, 3))
            .collect();
        let text = random_string(&mut rng, 24);
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let mut cuts: Vec<usize> = chars
            .iter()
            .map(|(i, _)| *i)
            .filter(|_| rng.below(3) == 0)
            .collect();
        cuts.push(text.len());
        let mut deltas = Vec::new();
        let mut from = 0;
        for c in cuts {
            deltas.push(&text[from..c]);
            from = c;
        }
        let expect = apply_stop(&stops, &text);
        let got = stream(&stops, &deltas);
        assert_eq!(
            got, expect,
            "stops {stops:?} text {text:?} deltas {deltas:?}"
        );
        // After a stop, no stop string is in the released output.
        if expect.1.is_some() {
            for s in stops.iter().filter(|s| !s.is_empty()) {
                assert!(!got.0.contains(s.as_str()));
            }
        }
    }
}
