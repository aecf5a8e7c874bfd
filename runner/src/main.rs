fn main() {
    std::process::exit(byoc_runner::cli::main());
}
