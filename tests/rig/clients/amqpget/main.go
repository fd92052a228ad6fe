// Command amqpget reads every message waiting in a RabbitMQ queue with RabbitMQ's own
// Go client and prints one JSON object per message: routing key, the properties and
// headers as the broker delivered them, and the body. The tests use it to see what a
// consumer that is not the relay's own client sees.
//
//	amqpget -url amqp://guest:guest@127.0.0.1:5672/%2f -queue q -count 3
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

type delivered struct {
	RoutingKey   string                 `json:"routing_key"`
	MessageID    string                 `json:"message_id"`
	ContentType  string                 `json:"content_type"`
	Timestamp    int64                  `json:"timestamp"`
	DeliveryMode uint8                  `json:"delivery_mode"`
	Headers      map[string]interface{} `json:"headers"`
	Body         string                 `json:"body"`
}

func main() {
	url := flag.String("url", "", "AMQP URL")
	queue := flag.String("queue", "", "queue to read")
	count := flag.Int("count", 1, "messages to wait for")
	wait := flag.Duration("wait", 30*time.Second, "how long to wait for them")
	flag.Parse()
	conn, err := amqp.Dial(*url)
	if err != nil {
		fail("connect: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		fail("channel: %v", err)
	}
	deadline := time.Now().Add(*wait)
	enc := json.NewEncoder(os.Stdout)
	for got := 0; got < *count; {
		msg, ok, err := ch.Get(*queue, true)
		if err != nil {
			fail("get: %v", err)
		}
		if !ok {
			if time.Now().After(deadline) {
				fail("only %d of %d messages in %s", got, *count, *queue)
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		headers := map[string]interface{}{}
		for k, v := range msg.Headers {
			if b, isBytes := v.([]byte); isBytes {
				v = string(b)
			}
			headers[k] = v
		}
		var ts int64
		if !msg.Timestamp.IsZero() {
			ts = msg.Timestamp.Unix()
		}
		out := delivered{
			RoutingKey:   msg.RoutingKey,
			MessageID:    msg.MessageId,
			ContentType:  msg.ContentType,
			Timestamp:    ts,
			DeliveryMode: msg.DeliveryMode,
			Headers:      headers,
			Body:         string(msg.Body),
		}
		if err := enc.Encode(out); err != nil {
			fail("print: %v", err)
		}
		got++
	}
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "amqpget: "+format+"\n", args...)
	os.Exit(1)
}
