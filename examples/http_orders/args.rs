//! The command line.

use std::net::SocketAddr;

use idempotency::InFlight;

/// The command line.
#[derive(Debug)]
pub struct Args {
    /// Where to listen.
    pub addr: SocketAddr,
    /// A SQLite path or a database URL; see [`super::database::open`].
    pub database: String,
    /// What a request does while another holds its key.
    pub in_flight: InFlight,
}

const USAGE: &str =
    "usage: http_orders [--addr HOST:PORT] [--database PATH|postgres://...|mysql://...] [--in-flight-wait MS]";

/// Parses the arguments after the program name.
///
/// # Errors
///
/// A message for an unknown argument or a missing or malformed value.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
        database: String::from("http_orders.db"),
        in_flight: InFlight::Wait(chrono::Duration::milliseconds(5000)),
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--addr" => parsed.addr = value()?.parse().map_err(|error| format!("--addr: {error}"))?,
            "--database" => parsed.database = value()?,
            "--in-flight-wait" => {
                let millis: u32 = value()?.parse().map_err(|error| format!("--in-flight-wait: {error}"))?;
                parsed.in_flight = match millis {
                    0 => InFlight::Reject,
                    millis => InFlight::Wait(chrono::Duration::milliseconds(millis.into())),
                };
            }
            "--help" | "-h" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    #[test]
    fn in_flight_wait_zero_rejects_at_once() {
        use idempotency::InFlight;

        let args = |list: &[&str]| super::parse(list.iter().map(|arg| arg.to_string()));
        assert_eq!(
            args(&["--in-flight-wait", "0"]).expect("parse").in_flight,
            InFlight::Reject
        );
        assert_eq!(
            args(&[]).expect("parse").in_flight,
            InFlight::Wait(chrono::Duration::seconds(5))
        );
        let negative = args(&["--in-flight-wait", "-1"]);
        assert!(
            matches!(&negative, Err(message) if message.starts_with("--in-flight-wait: invalid digit")),
            "{negative:?}"
        );
        let unknown = args(&["--port", "80"]);
        assert!(
            matches!(&unknown, Err(message) if message.starts_with("unknown argument --port\nusage: http_orders")),
            "{unknown:?}"
        );
    }
}
