//! What the benches share: their command line's common options and a
//! database of their own for one run.

use std::sync::atomic::{AtomicU64, Ordering};

/// The options every bench takes.
pub struct Args {
    /// `sqlite`, `postgres` or `mysql`.
    pub backend: String,
    /// Every count cut, so that a run takes seconds.
    pub quick: bool,
}

/// Reads `--backend NAME` and `--quick`, passes over the `--bench` that
/// cargo bench gives every bench binary, and hands any other argument to
/// `other` with the arguments after it; `usage` is the error without a
/// backend.
pub fn parse_args(
    usage: &str,
    mut other: impl FnMut(&str, &mut dyn Iterator<Item = String>) -> Result<(), String>,
) -> Result<Args, String> {
    let mut backend = None;
    let mut quick = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--backend" => backend = Some(args.next().ok_or("--backend needs sqlite, postgres or mysql")?),
            "--quick" => quick = true,
            "--bench" => {}
            _ => other(&arg, &mut args)?,
        }
    }
    let backend = backend.ok_or(usage)?;
    Ok(Args { backend, quick })
}

/// A database of its own for one run, removed when dropped: a file in a
/// temporary directory on SQLite, a schema in the database `DATABASE_URL`
/// names on PostgreSQL (`CITUS_DATABASE_URL`, a Citus coordinator, on
/// `citus`), a database on the server `MYSQL_URL` names on MySQL.
pub struct Scratch {
    url: String,
    place: Place,
}

enum Place {
    Sqlite {
        _dir: tempfile::TempDir,
    },
    #[cfg(feature = "postgres")]
    Postgres {
        base_url: String,
        schema: String,
    },
    #[cfg(feature = "mysql")]
    Mysql {
        base_url: String,
        name: String,
    },
}

impl Scratch {
    /// A new database on `backend`, named after `prefix`, the process id
    /// and a count.
    pub fn new(backend: &str, prefix: &str) -> anyhow::Result<Scratch> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{prefix}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        match backend {
            "sqlite" => {
                let dir = tempfile::tempdir()?;
                let url = dir.path().join(name + ".db").to_str().expect("utf-8 path").to_owned();
                Ok(Scratch {
                    url,
                    place: Place::Sqlite { _dir: dir },
                })
            }
            #[cfg(feature = "postgres")]
            "postgres" | "citus" => {
                use diesel::{Connection, connection::SimpleConnection};
                let (variable, example) = if backend == "citus" {
                    (
                        "CITUS_DATABASE_URL",
                        "postgres://postgres@127.0.0.1:5460/test, a Citus coordinator",
                    )
                } else {
                    ("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
                };
                let base_url =
                    std::env::var(variable).map_err(|_| anyhow::anyhow!("set {variable}, e.g. {example}"))?;
                let schema = name;
                diesel::PgConnection::establish(&base_url)?.batch_execute(&format!("CREATE SCHEMA {schema}"))?;
                let separator = if base_url.contains('?') { '&' } else { '?' };
                let url = format!("{base_url}{separator}options=-csearch_path%3D{schema}");
                Ok(Scratch {
                    url,
                    place: Place::Postgres { base_url, schema },
                })
            }
            #[cfg(feature = "mysql")]
            "mysql" => {
                use diesel::{Connection, connection::SimpleConnection};
                let base_url = std::env::var("MYSQL_URL")
                    .map_err(|_| anyhow::anyhow!("set MYSQL_URL, e.g. mysql://root@127.0.0.1:3306/test"))?;
                diesel::MysqlConnection::establish(&base_url)?.batch_execute(&format!("CREATE DATABASE {name}"))?;
                let server = match base_url.split_once("://") {
                    Some((scheme, rest)) => format!("{scheme}://{}", rest.split(['/', '?']).next().unwrap_or(rest)),
                    None => base_url.clone(),
                };
                let url = format!("{server}/{name}");
                Ok(Scratch {
                    url,
                    place: Place::Mysql { base_url, name },
                })
            }
            other => anyhow::bail!("unknown backend {other}: sqlite, or postgres, citus or mysql with their features"),
        }
    }

    /// The URL to connect to it with.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        use diesel::{Connection, connection::SimpleConnection};
        match &self.place {
            Place::Sqlite { .. } => {}
            #[cfg(feature = "postgres")]
            Place::Postgres { base_url, schema } => {
                if let Ok(mut admin) = diesel::PgConnection::establish(base_url) {
                    let _ = admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
                }
            }
            #[cfg(feature = "mysql")]
            Place::Mysql { base_url, name } => {
                if let Ok(mut admin) = diesel::MysqlConnection::establish(base_url) {
                    let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}"));
                }
            }
        }
    }
}
