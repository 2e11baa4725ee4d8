fn main() {
    println!("tch cuda available: {}", tch::Cuda::is_available());
}
