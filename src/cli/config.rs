//! `flotilla config`: the configuration reference, generated from the configuration types
//! (`node/config/reference.rs`); `docs/config-reference.md` is its committed output, and a
//! test fails when the two differ.

/// Options of `flotilla config`.
#[derive(Clone, Debug, clap::Args)]
pub struct ConfigArgs {
    /// Print the configuration reference as Markdown: every key (its dotted path), its type,
    /// default, unit and doc — what `docs/config-reference.md` holds.
    #[arg(long, required = true)]
    pub reference: bool,
}

/// Prints what `a` asks for on standard output.
///
/// # Errors
/// Standard output cannot be written.
pub fn run(a: &ConfigArgs) -> anyhow::Result<()> {
    if a.reference {
        let text = crate::node::config::reference::markdown() + "\n";
        super::print_out(&mut std::io::stdout().lock(), &text)?;
    }
    Ok(())
}
