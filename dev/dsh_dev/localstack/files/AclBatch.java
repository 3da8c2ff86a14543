// Runs Kafka's own kafka-acls (org.apache.kafka.tools.AclCommand) once per line of an argument
// file (arguments separated by tabs), all in one JVM: a JVM start per ACL group took minutes
// on a loaded machine. Launched as a single-file source program by
// pipeline/adapters/secure/acls.py. AclCommand exits the JVM with status 1 on any failure.
import java.nio.file.Files;
import java.nio.file.Path;

public class AclBatch {
    public static void main(String[] args) throws Exception {
        for (String line : Files.readAllLines(Path.of(args[0]))) {
            if (!line.isBlank()) {
                org.apache.kafka.tools.AclCommand.main(line.split("\t"));
            }
        }
    }
}
